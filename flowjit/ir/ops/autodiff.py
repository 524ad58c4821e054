"""Ops that exist for automatic differentiation: `stop_gradient` and `custom_vjp_call`.

Both are identities on values; what makes them special is their VJP rule in the autodiff pass
(`flowjit/passes/autodiff.py`). The frontend emits them only while tracing a function that will be
differentiated and drops them when it inlines a gradient into an ordinary `jit` trace, so compiled
graphs rarely contain them; a backend that meets one lowers it as the identity.

    stop_gradient(x) -> x                         the gradient of its result is not propagated
    custom_vjp_call(*ins, *res, *outs) -> outs    {rule, num_inputs, num_residuals}: the results
        are `outs`; their gradient w.r.t. `ins` is the user's backward function `rule` applied to
        the residuals `res` (looked up in `flowjit.frontend.grad`'s rule table)
"""

from __future__ import annotations

from flowjit.errors import ShapeError
from flowjit.ir.ops.registry import CONTROL, ELEMENTWISE_UNARY, defop

defop(
    "stop_gradient",
    ELEMENTWISE_UNARY,
    lambda types, attrs: [types[0]],
    lambda x: x.copy(),
    1,
    doc="the identity; differentiation treats its result as a constant",
)


def _custom_vjp_call_rule(types, attrs):
    num_inputs, num_residuals = attrs["num_inputs"], attrs["num_residuals"]
    if not isinstance(attrs["rule"], int) or num_inputs < 0 or num_residuals < 0:
        raise ShapeError("'rule', 'num_inputs' and 'num_residuals' must be non-negative ints")
    if num_inputs + num_residuals > len(types):
        raise ShapeError(f"expects at least {num_inputs + num_residuals} operands; found {len(types)}")
    return list(types[num_inputs + num_residuals :])


def _custom_vjp_call(*arrays, rule, num_inputs, num_residuals):
    outs = tuple(a.copy() for a in arrays[num_inputs + num_residuals :])
    return outs[0] if len(outs) == 1 else outs


defop(
    "custom_vjp_call",
    CONTROL,
    _custom_vjp_call_rule,
    _custom_vjp_call,
    None,
    attrs=("rule", "num_inputs", "num_residuals"),
    doc="the identity on its last operands, differentiated by a user-defined backward rule",
)
