"""Every op flowjit knows, one definition each. Importing this package registers them all."""

from flowjit.ir.ops import (  # noqa: F401
    autodiff,
    bitwise,
    communication,
    contraction,
    control,
    creation,
    elementwise,
    fusion,
    movement,
    reduction,
    stateful,
)
from flowjit.ir.ops.registry import (  # noqa: F401
    COMMUNICATION,
    CONTRACTION,
    CONTROL,
    CONVERSION,
    CREATION,
    ELEMENTWISE_BINARY,
    ELEMENTWISE_FAMILIES,
    ELEMENTWISE_TERNARY,
    ELEMENTWISE_UNARY,
    MOVEMENT,
    REDUCTION,
    REGISTRY,
    STATEFUL,
    WINDOW,
    OpDef,
    get_opdef,
    ops_in,
)
