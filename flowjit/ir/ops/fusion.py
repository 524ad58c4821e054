"""`fusion`: a group of ops that the backend emits as one kernel (made by the `fuse` pass).

    fusion(*xs) {kind}     region (body): (*xs) -> results

Like the control-flow ops, the body is a self-contained graph whose parameters are the op's
operands (the values the group reads from outside) and whose results are the group's values used
outside it. Running the op runs its body once. `kind` says what the group is built around:
"loop" (elementwise ops, broadcasts, reshapes, converts), "reduction" (reductions with their
elementwise producers and consumers) or "output" (a contraction or convolution and its
elementwise epilogue).
"""

from __future__ import annotations

from flowjit.errors import ShapeError
from flowjit.ir.ops.registry import CONTROL, defop

FUSION_KINDS = ("loop", "reduction", "output")


def _fusion_rule(types, attrs):
    if attrs["kind"] not in FUSION_KINDS:
        raise ShapeError(f"kind must be one of {', '.join(FUSION_KINDS)}; found {attrs['kind']!r}")
    regions = attrs.get("__regions__")
    if regions is None:
        raise ShapeError("a fusion op needs its region to infer result types")
    (body,) = regions
    if body.param_types != list(types):
        found = ", ".join(str(t) for t in body.param_types)
        passed = ", ".join(str(t) for t in types)
        raise ShapeError(f"the fused body takes ({found}); the op passes ({passed})")
    return list(body.result_types)


defop(
    "fusion",
    CONTROL,
    _fusion_rule,
    None,
    None,
    attrs=("kind",),
    num_regions=1,
    doc="run the fused body once; the backend emits it as one kernel",
)
