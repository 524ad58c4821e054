"""A compiled function's body cut into one piece per op, and kernel sharing: ops whose kernels are
the same text (a deep network's identical layers, their gradients) become one private function of
the module, called from each of them, so that MLIR and LLVM compile it once (`shared_kernels`).
`lowering.lower_graph` also splits a large function between pieces (`MlirModule.parts`)."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

from flowjit.backends.mlir.emitter import KernelEmitter
from flowjit.ir.graph import Graph, Op

# What vectorizing a kernel by its transform schedule adds to the compile, in lines of the lowering's
# MLIR (`_Piece.cost`): each op of the MLP step, lowered as a module of its own, costs about 0.14 ms
# of MLIR and LLVM per line plus 2-4 ms per scheduled kernel on a 2-core AMD EPYC Zen 4 VM, so a
# schedule costs about as much as 20 lines.
SCHEDULED_KERNEL_COST = 20


@dataclass
class Piece:
    """One op's share of a function: its lines in the entry and its kernels' schedules; when the op
    calls a shared kernel function (`shared_kernels`), the function's name and parameter types,
    and at its first call, the function's lines."""

    lines: list[str]
    schedules: list[str]
    callee: str | None = None
    types: str = ""
    function: list[str] = ()

    @property
    def weight(self) -> int:
        """Lines of MLIR it adds to a module (`SPLIT_MIN_LINES`)."""
        return len(self.lines) + len(self.function)

    @property
    def cost(self) -> int:
        """Its compile time in lines of MLIR, to balance the parts of a split function: a kernel that
        its transform schedule vectorizes costs `SCHEDULED_KERNEL_COST` lines more."""
        return self.weight + SCHEDULED_KERNEL_COST * len(self.schedules)


def op_pieces(em: KernelEmitter, prologue: int, starts: list[tuple[int, int]]) -> list[Piece]:
    """The body after the prologue, cut where each op begins (`_lower_function`'s `starts`)."""
    bounds = [(prologue, 0), *starts[1:], (len(em.body), len(em.schedules))]
    return [Piece(em.body[l0:l1], em.schedules[s0:s1]) for (l0, s0), (l1, s1) in zip(bounds, bounds[1:])]


def _signature(op: Op) -> tuple:
    return op.name, tuple(v.type for v in op.operands), tuple(v.type for v in op.results)


def may_repeat(graph: Graph) -> bool:
    """Whether two top-level ops have the same name and types: their kernels may be the same text
    (`shared_kernels`)."""
    seen = set()
    for op in graph.ops:
        if op.name == "constant":
            continue
        key = _signature(op)
        if key in seen:
            return True
        seen.add(key)
    return False


# SSA names (`%v12`, `%in0`, `%ws`; `%v3#1` is a result of `%v3`) and kernel tags in the lowering's text.
_SSA = re.compile(r"%[A-Za-z_][\w$]*")
_TAG = re.compile(r"fj\.kernel = (\d+) : i64")
# A shared kernel function of a module that is not split is internal to it (not exported by the
# AOT library; `private` alone still gives LLVM's external linkage).
INTERNAL_LINKAGE = "llvm.linkage = #llvm.linkage<internal>"
_DEFINED = re.compile(r"^\s*(%[\w$]+) = (.*)$")


def shared_kernels(
    em: KernelEmitter,
    lowered: list[Op],
    name: str,
    args: list[str],
    prologue: int,
    starts: list[tuple[int, int]],
) -> list[Piece] | None:
    """The function's pieces with the ops whose kernels are the same text (up to SSA names and kernel
    tags: a deep network's identical layers, their gradients) made one private function each,
    called from every op that runs it, so that MLIR and LLVM compile it once (`may_repeat` found
    candidates); None when no two are the same. The function was lowered op by op (`start_op`):
    an op's lines use only the entry's arguments and prologue (workspace views), which become the
    kernel function's parameters, in order of first use. Ops that occur once stay in the entry.
    `lowered`: the top-level ops, one per piece.
    """
    if not starts or starts[0][0] != prologue:
        return None
    # The entry's arguments and prologue values: what an op's lines may take from outside.
    outside: dict[str, str] = {}  # SSA name -> its type, argument attributes included
    for arg in args:
        arg_name, arg_type = arg.split(": ", 1)
        outside[arg_name] = arg_type
    for line in em.body[:prologue]:
        m = _DEFINED.match(line)
        if m is None:
            return None
        rhs = m.group(2)
        if rhs.startswith("memref.view "):
            outside[m.group(1)] = rhs.rsplit(" to ", 1)[1]
        elif rhs.startswith("arith.constant "):
            outside[m.group(1)] = rhs.rsplit(": ", 1)[1]
        elif rhs.startswith(("memref.collapse_shape ", "memref.expand_shape ")):  # a reshape's view
            outside[m.group(1)] = rhs.rsplit(" into ", 1)[1]
        else:
            return None
    pieces = op_pieces(em, prologue, starts)
    # Only ops of the same name, types and numbers of lines and schedules can be the same text.
    signatures = [(_signature(op), len(piece.lines), len(piece.schedules)) for op, piece in zip(lowered, pieces)]
    repeats = Counter(signatures)
    candidates = {s for s, n in repeats.items() if n >= 2} if len(lowered) == len(pieces) else set()
    keyed = [
        (piece, *_canonical(piece.lines, piece.schedules, outside))
        for piece, signature in zip(pieces, signatures)
        if signature in candidates
    ]
    counts: dict = {}
    for _, _, key in keyed:
        counts[key] = counts.get(key, 0) + 1
    if not counts or max(counts.values()) < 2:
        return None
    shared: dict = {}  # key -> the first piece calling its function
    for piece, params, key in keyed:
        if counts[key] < 2:
            continue
        first = shared.get(key)
        if first is None:
            callee = f"{name}_kernel{len(shared)}"
            # The parameters keep the first op's names for the buffers: its lines are the body as they are.
            decls = ", ".join(f"{p}: {outside[p]}" for p in params)
            piece.function = [
                f"  func.func private @{callee}({decls}) attributes {{{INTERNAL_LINKAGE}}} {{",
                f"    // the kernel of {counts[key]} ops, called from each (the same text up to SSA names)",
                *piece.lines,
                "    return",
                "  }",
            ]
            piece.callee = callee
            piece.types = ", ".join(outside[p].split(" {", 1)[0] for p in params)  # without argument attributes
            first = shared[key] = piece
        else:
            piece.schedules = []  # the first piece's apply to the one function
            piece.callee, piece.types = first.callee, first.types
        piece.lines = [f"    func.call @{piece.callee}({', '.join(params)}) : ({piece.types}) -> ()"]
    return pieces


def _canonical(lines: list[str], schedules: list[str], outside: dict[str, str]) -> tuple[list[str], tuple]:
    """An op's outside names (its kernel function's parameters, in order of first use) and a key
    equal for ops whose lines and schedules are the same text up to SSA names and kernel tags: the
    text without them, each name's and tag's rank among the distinct ones in order of first use,
    and which names are parameters, with their types."""
    text = "\n".join([*lines, *schedules])
    tokens = _SSA.findall(text)
    rank = {token: i for i, token in enumerate(dict.fromkeys(tokens))}
    tags = _TAG.findall(text)
    tag_rank = {tag: i for i, tag in enumerate(dict.fromkeys(tags))}
    params = [token for token in rank if token in outside]
    key = (
        _TAG.sub("fj.kernel", _SSA.sub("%", text)),
        tuple(rank[t] for t in tokens),
        tuple(tag_rank[t] for t in tags),
        tuple(rank[p] for p in params),
        tuple(outside[p] for p in params),
    )
    return params, key
