"""The op registry: each op is defined once, with its family, attributes, shape/dtype rule and numpy
reference implementation. VJP rules live in the autodiff pass's table and lowerings in each backend's
table; both look ops up here by name.

Families drive generic rules (broadcasting in the frontend, fusion legality, DCE of pure ops):
`ops_in(ELEMENTWISE_UNARY)` is the set of names in one family.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from flowjit.errors import FlowjitValueError

ELEMENTWISE_UNARY = "elementwise_unary"
ELEMENTWISE_BINARY = "elementwise_binary"
ELEMENTWISE_TERNARY = "elementwise_ternary"  # select
CREATION = "creation"  # constant, iota
CONVERSION = "conversion"  # convert (elementwise, changes dtype)
REDUCTION = "reduction"
MOVEMENT = "movement"
CONTRACTION = "contraction"
WINDOW = "window"  # reduce_window (pooling)
STATEFUL = "stateful"
COMMUNICATION = "communication"
CONTROL = "control"

FAMILIES = (
    ELEMENTWISE_UNARY,
    ELEMENTWISE_BINARY,
    ELEMENTWISE_TERNARY,
    CREATION,
    CONVERSION,
    REDUCTION,
    MOVEMENT,
    CONTRACTION,
    WINDOW,
    STATEFUL,
    COMMUNICATION,
    CONTROL,
)
ELEMENTWISE_FAMILIES = frozenset({ELEMENTWISE_UNARY, ELEMENTWISE_BINARY, ELEMENTWISE_TERNARY, CONVERSION})
# Families whose ops have effects beyond their results: never removed by DCE, never reordered, CSE'd
# or constant-folded.
EFFECTFUL_FAMILIES = frozenset({STATEFUL, COMMUNICATION})


@dataclass(frozen=True)
class OpDef:
    """One op's definition.

    infer(types, attrs) -> list of result TensorTypes; raises `ShapeError` with a readable message.
    impl(*arrays, **attrs) -> array or tuple of arrays: the numpy reference semantics.
    attrs: required attribute names; `defaults` fills optional ones.
    arity: number of operands, or None for variadic ops.
    """

    name: str
    family: str
    infer: Callable
    impl: Callable | None
    arity: int | None
    attrs: tuple[str, ...] = ()
    defaults: dict = field(default_factory=dict)
    num_regions: int = 0
    doc: str = ""

    @property
    def effectful(self) -> bool:
        return self.family in EFFECTFUL_FAMILIES

    @property
    def elementwise(self) -> bool:
        return self.family in ELEMENTWISE_FAMILIES


REGISTRY: dict[str, OpDef] = {}


def register(opdef: OpDef) -> OpDef:
    if opdef.name in REGISTRY:
        raise RuntimeError(f"op '{opdef.name}' is defined twice")
    if opdef.family not in FAMILIES:
        raise RuntimeError(f"op '{opdef.name}' has unknown family '{opdef.family}'")
    REGISTRY[opdef.name] = opdef
    return opdef


def _quiet(impl: Callable) -> Callable:
    """`impl` without numpy's floating-point warnings: nan, inf and integer wrap-around are the
    defined results of ops (log(0) = -inf), not mistakes to report on every evaluation."""

    @functools.wraps(impl)
    def quiet_impl(*args, **kwargs):
        with np.errstate(all="ignore"):
            return impl(*args, **kwargs)

    return quiet_impl


def defop(name, family, infer, impl, arity, attrs=(), defaults=None, num_regions=0, doc=""):
    """Define and register an op; returns its `OpDef`."""
    impl = _quiet(impl) if impl is not None else None
    return register(OpDef(name, family, infer, impl, arity, tuple(attrs), dict(defaults or {}), num_regions, doc))


def get_opdef(name: str) -> OpDef:
    """The definition of op `name`; a clear error (not a KeyError) if there is none."""
    opdef = REGISTRY.get(name)
    if opdef is None:
        raise FlowjitValueError(f"unknown op '{name}'; known ops: {', '.join(sorted(REGISTRY))}")
    return opdef


def ops_in(*families: str) -> frozenset[str]:
    """Names of the registered ops in the given families."""
    return frozenset(n for n, d in REGISTRY.items() if d.family in families)
