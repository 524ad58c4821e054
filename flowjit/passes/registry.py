"""The pass registry and pipeline runner.

A pass is a named function `Graph -> Graph`, registered under a kebab-case name with `@register`.
`run_pipeline` applies passes in order, verifying after each when asked (tests and
`FLOWJIT_VERIFY=1`) and writing each stage's IR to `FLOWJIT_DUMP_DIR` when set.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from flowjit.errors import FlowjitValueError
from flowjit.ir.graph import Graph
from flowjit.passes import dump

PASSES: dict[str, Callable[[Graph], Graph]] = {}


def register(name: str):
    """Register a `Graph -> Graph` pass under `name` (kebab-case)."""

    def deco(fn):
        if name in PASSES:
            raise RuntimeError(f"pass '{name}' is registered twice")
        PASSES[name] = fn
        return fn

    return deco


def get_pass(name: str) -> Callable[[Graph], Graph]:
    _load_builtin_passes()
    if name not in PASSES:
        raise FlowjitValueError(f"unknown pass '{name}'; known passes: {', '.join(sorted(PASSES))}")
    return PASSES[name]


def parse_pipeline(text: str | Sequence[str]) -> list[str]:
    """'canonicalize,fuse' -> ['canonicalize', 'fuse'], each checked to exist."""
    names = [n.strip() for n in text.split(",")] if isinstance(text, str) else list(text)
    names = [n for n in names if n]
    for n in names:
        get_pass(n)
    return names


def run_pipeline(graph: Graph, names: Sequence[str], verify: bool | None = None, dump_name: str | None = None) -> Graph:
    """Apply the named passes in order; verify after each when `verify` (default: FLOWJIT_VERIFY)."""
    from flowjit.ir.printer import print_graph
    from flowjit.ir.verifier import VerificationError
    from flowjit.ir.verifier import verify as verify_graph
    from flowjit.passes.fuse import fusion_summary

    if verify is None:
        verify = dump.verify_enabled()
    for name in names:
        graph = get_pass(name)(graph)
        # Dump before verifying, so that invalid IR can be inspected.
        if dump.dump_dir() is not None:
            dump.write_stage(dump_name or graph.name, name, print_graph(graph, fusion_summary(graph)))
        if verify:
            try:
                verify_graph(graph)
            except VerificationError as e:
                raise VerificationError(f"invalid IR after pass '{name}' (a compiler bug): {e}") from None
    return graph


def _load_builtin_passes() -> None:
    from flowjit.passes import canonicalize, fuse, partition, place, state  # noqa: F401
