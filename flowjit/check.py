"""`flowjit check`: the fuzzer's differential check, for a user's own function.

The traced graph, run by the reference interpreter, is the reference. Every later stage must agree
with it: the graph after each pass of the pipeline (in order, each on the previous one's output),
then the compiled code. The first stage that disagrees is named, with the op whose result differs
and the user's source line that created it: a wrong answer is bisected to one pass (or the backend).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from flowjit.backends import default_target
from flowjit.errors import CompileError
from flowjit.ir import dtypes as dt
from flowjit.ir.graph import Graph
from flowjit.ir.interpreter import RunContext, interpret
from flowjit.ir.parser import parse_graph
from flowjit.ir.printer import print_graph

# Allowed |found - expected| <= RTOL * max(1, max |expected|), per result dtype; ints and bools exact.
RTOL = {"f16": 1e-2, "bf16": 5e-2, "f32": 1e-4, "f64": 1e-9}


@dataclass
class Stage:
    """One stage's verdict: `problem` is None when it agrees with the reference."""

    name: str
    problem: str | None = None
    culprit: str | None = None  # the op whose result differs, and where the user wrote it
    skipped: str | None = None


@dataclass
class CheckReport:
    """The stages checked, in order; `first_failure` is the stage to blame."""

    stages: list[Stage] = field(default_factory=list)

    @property
    def first_failure(self) -> Stage | None:
        return next((s for s in self.stages if s.problem is not None), None)

    def format(self, title: str) -> str:
        lines = [title]
        for s in self.stages:
            verdict = s.problem or (f"skipped: {s.skipped}" if s.skipped else "ok")
            lines.append(f"  {s.name:<24} {'MISMATCH: ' if s.problem else ''}{verdict}")
            if s.culprit:
                lines.append(f"  {'':<24} first differing result: {s.culprit}")
        bad = self.first_failure
        skipped = sum(s.skipped is not None for s in self.stages)
        if bad is None and skipped:
            lines.append(f"result: every stage that ran agrees with the reference interpreter ({skipped} skipped)")
        elif bad is None:
            lines.append("result: every stage agrees with the reference interpreter")
        else:
            lines.append(f"result: {bad.name} changes the result" + (f" ({bad.culprit})" if bad.culprit else ""))
        return "\n".join(lines)


def random_arguments(types: Sequence, seed: int = 0) -> list[np.ndarray]:
    """Arguments for abstract `types` (ShapeDtype-like: .shape, .dtype): floats in [-2, 2), ints in
    [0, 4) (valid as small indices), bools half true."""
    rng = np.random.default_rng(seed)
    arrays = []
    for t in types:
        dtype = dt.dtype(t.dtype)
        if dtype.is_float:
            arrays.append(rng.uniform(-2, 2, t.shape).astype(dtype.np_dtype))
        elif dtype.is_bool:
            arrays.append(rng.random(t.shape) < 0.5)
        else:
            arrays.append(rng.integers(0, 4, t.shape).astype(dtype.np_dtype))
    return arrays


def _difference(found: np.ndarray, expected: np.ndarray) -> str | None:
    """A one-line description of how `found` differs from `expected`, or None if they agree."""
    if found.shape != expected.shape or found.dtype != expected.dtype:
        return f"expected {expected.dtype}{list(expected.shape)}, found {found.dtype}{list(found.shape)}"
    rtol = RTOL.get(dt.dtype(expected.dtype).name)
    if rtol is None:
        bad = found != expected
    else:
        f, e = found.astype(np.float64), expected.astype(np.float64)
        scale = max(1.0, float(np.max(np.abs(e), initial=0.0, where=np.isfinite(e))))
        with np.errstate(invalid="ignore"):
            bad = ~((np.abs(f - e) <= rtol * scale) | (np.isnan(f) & np.isnan(e)) | (f == e))
    if not np.any(bad):
        return None
    i = tuple(int(k) for k in np.argwhere(bad)[0])
    return f"{int(np.sum(bad))} of {bad.size} elements differ; at {list(i)} expected {expected[i]}, found {found[i]}"


def _compare(found: list, expected: list, graph: Graph, stage: Stage) -> None:
    for k, (f, e) in enumerate(zip(found, expected)):
        problem = _difference(np.asarray(f), np.asarray(e))
        if problem is None:
            continue
        stage.problem = f"result {k}: {problem}"
        if k < len(graph.results) and graph.results[k].producer is not None:
            op = graph.results[k].producer
            stage.culprit = f"op '{op.name}' at {op.loc}"
        return


def check_lowered(lowered, args: Sequence[np.ndarray], pipeline: Sequence[str]) -> CheckReport:
    """Check every stage of `lowered` (a `fj.jit(...).lower(...)` result) on `args`."""
    from flowjit.ir.verifier import VerificationError, verify
    from flowjit.passes.registry import get_pass

    report = CheckReport()
    traced = lowered.graph("traced")
    variables = {name: v.numpy() for name, v in lowered.variables.items()}

    def run(graph: Graph) -> list[np.ndarray]:
        buffers = {name: value.copy() for name, value in variables.items()}
        return interpret(graph, list(args), RunContext(buffers)) + [buffers[n] for n in sorted(buffers)]

    reference = run(traced)
    report.stages.append(Stage("traced (reference)"))
    graph = traced
    for name in pipeline:
        stage = Stage(f"pass '{name}'")
        report.stages.append(stage)
        graph = get_pass(name)(parse_graph(print_graph(graph)))
        try:
            verify(graph)
        except VerificationError as e:
            stage.problem = f"invalid IR after the pass: {e}"
        if stage.problem is None:
            _compare(run(graph), reference, graph, stage)
        if stage.problem is not None:
            return report
    stage = Stage(f"compiled ({lowered.target or default_target()})")
    report.stages.append(stage)
    try:
        compiled = lowered.compile()
    except CompileError as e:
        # An op the backend does not lower yet is a missing feature, not a wrong answer.
        if "has no lowering" in str(e):
            stage.skipped = str(e)
        else:
            stage.problem = f"compilation failed: {e}"
        return report
    for name, v in lowered.variables.items():
        v.assign(variables[name])
    outs = compiled.executable.run(list(args), {v.name: v.buffer for v in lowered.variables.values()})
    finals = {name: v.numpy() for name, v in lowered.variables.items()}
    for name, v in lowered.variables.items():
        v.assign(variables[name])  # a check leaves the user's variables as it found them
    _compare(list(outs) + [finals[n] for n in sorted(finals)], reference, lowered.graph("optimized"), stage)
    return report
