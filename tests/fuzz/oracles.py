"""The oracles: one program, run every way flowjit can run it, compared.

    numpy        the program's numpy rendering (float64, independent of flowjit's op impls)
    interpreter  `fj.jit(program, target="interpreter")`: the reference semantics of the traced IR
    cpu          `fj.jit(program)` compiled by the CPU backend, when every op has a CPU lowering
    each pass    the traced graph interpreted before and after every registered pass, alone
    gradients    (smooth programs) `fj.grad` compiled and interpreted, and central finite differences
    forward      (smooth programs) `fj.jvp` against the VJP by <J t, c> = <t, J^T c>, compiled and
                 interpreted; `fj.jacfwd` against `fj.jacrev`

Any disagreement raises `Mismatch`, naming the two oracles, the output and, for a pass, the pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

import flowjit as fj
import flowjit.nn as nn
import flowjit.numpy as fnp
from flowjit.errors import CompileError
from flowjit.ir import dtypes as dt
from flowjit.ir.graph import Graph
from flowjit.ir.interpreter import RunContext, interpret
from flowjit.ir.parser import parse_graph
from flowjit.ir.printer import print_graph
from flowjit.ir.verifier import verify
from fuzz import numpy_ref

# Passes that assume another ran first: checked after their prerequisites (the comparison is still
# against the traced graph, so a wrong prerequisite shows up under its own name first).
PREREQUISITES = {"partition": ("place",)}

# Passes that change how a graph with variables is called (variables become parameters and results):
# on such graphs the before/after comparison would need the pass's own convention, so they are
# checked on stateless graphs only.
STATE_CONVENTION_PASSES = frozenset({"functionalize-state"})

# Relative tolerance per dtype; the absolute part scales it by the output's magnitude. Loose enough
# for a chain of ~10 rounded ops, far below what a wrong kernel produces.
RTOL = {"f16": 2e-2, "bf16": 8e-2, "f32": 2e-4, "f64": 1e-9}


class Mismatch(AssertionError):
    """Two oracles disagree on a program."""

    def __init__(self, message: str, where: str):
        super().__init__(message)
        self.where = where  # "cpu", "numpy", "pass:NAME", "grad", ...


@dataclass
class Outcome:
    """What one check ran: which oracles applied."""

    compiled: bool = False
    passes: list[str] = field(default_factory=list)
    ops: set[str] = field(default_factory=set)


def all_ops(graph: Graph) -> set[str]:
    """Names of the ops in `graph`, regions included."""
    return {op.name for op in graph.walk()}


def compile_if_supported(lowered):
    """`lowered.compile()`, or None when the CPU backend reports an op it does not lower yet. The
    backend is asked, not a list: programs with control flow or state join the compiled oracle as
    soon as it handles them (state ops, for one, compile through `functionalize-state`)."""
    try:
        return lowered.compile()
    except CompileError as e:
        if "has no lowering" in str(e):
            return None
        raise


def loosest_rtol(graph: Graph) -> float:
    """The tolerance of the least precise float dtype anywhere in `graph`: an output of float64
    computed from a float16 intermediate is only as accurate as float16."""
    names = {t.dtype.name for t in graph.param_types} | {r.type.dtype.name for op in graph.walk() for r in op.results}
    return max([RTOL[n] for n in names if n in RTOL], default=0.0)


def assert_close(actual, expected, what: str, where: str, rtol_floor: float = 0.0) -> None:
    actual, expected = np.asarray(actual), np.asarray(expected)
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        raise Mismatch(
            f"{what}: expected {expected.dtype}{list(expected.shape)}, found {actual.dtype}{list(actual.shape)}", where
        )
    name = dt.dtype(expected.dtype).name
    if name not in RTOL:
        bad = actual != expected
    else:
        a, e = actual.astype(np.float64), expected.astype(np.float64)
        rtol = max(RTOL[name], rtol_floor)
        scale = max(1.0, float(np.max(np.abs(e), initial=0.0, where=np.isfinite(e))))
        with np.errstate(invalid="ignore"):
            bad = ~((np.abs(a - e) <= rtol * scale) | (np.isnan(a) & np.isnan(e)) | (a == e))
    if np.any(bad):
        i = tuple(int(k) for k in np.argwhere(bad)[0])
        raise Mismatch(
            f"{what}: {int(np.sum(bad))} of {bad.size} elements differ; at index {list(i)}: "
            f"expected {expected[i]!r}, found {actual[i]!r}",
            where,
        )


def _flowjit_function(source: str, variables: dict[str, np.ndarray]):
    """`program` from `source`, with fresh `fj.Variable`s; returns (function, variables)."""
    fresh = {name: fj.Variable(np.array(init, copy=True)) for name, init in variables.items()}
    env = {"M": fnp, "FJ": fj, "nn": nn, "np": np, **fresh}
    exec(compile(source, "<fuzz program>", "exec"), env)
    return env["program"], fresh


def run_numpy(source: str, inputs: dict, variables: dict) -> list[np.ndarray]:
    """The numpy oracle: outputs, then the final value of each variable."""
    env = numpy_ref.namespace()
    fresh = {name: numpy_ref.Var(init) for name, init in variables.items()}
    env.update(fresh)
    exec(compile(source, "<fuzz program (numpy)>", "exec"), env)
    with np.errstate(all="ignore"):
        outs = env["program"](*[np.array(a, copy=True) for a in inputs.values()])
    return [np.asarray(o) for o in outs] + [v.buffer for v in fresh.values()]


def _run_flowjit(source: str, inputs: dict, variables: dict, target: str | None):
    fn, fresh = _flowjit_function(source, variables)
    outs = fj.jit(fn, target=target)(*inputs.values())
    return [np.asarray(o) for o in outs] + [v.numpy() for v in fresh.values()]


def _compare(actual: Sequence, expected: Sequence, names: Sequence[str], label: str, where: str, rtol: float) -> None:
    for a, e, n in zip(actual, expected, names):
        assert_close(a, e, f"{label}, output {n}", where, rtol)


def check_sources(fj_source: str, np_source: str, inputs: dict, variables: dict, passes: bool = True) -> Outcome:
    """Run every oracle on one program; raise `Mismatch` on the first disagreement."""
    outcome = Outcome()
    fn, fresh = _flowjit_function(fj_source, variables)
    lowered = fj.jit(fn).lower(*inputs.values())
    traced = lowered.graph("traced")
    outcome.ops = all_ops(traced)
    names = [f"#{i}" for i in range(len(traced.results))] + [f"variable {n}" for n in variables]
    rtol = loosest_rtol(traced)

    reference = _run_flowjit(fj_source, inputs, variables, target="interpreter")
    expected = run_numpy(np_source, inputs, variables)
    _compare(reference, expected, names, "interpreter vs numpy", "numpy", rtol)

    if passes:
        outcome.passes = check_each_pass(traced, list(inputs.values()), variables, fresh, lowered.variables, rtol)

    executable = compile_if_supported(lowered)
    if executable is not None:
        outcome.compiled = True
        outs = executable(*inputs.values())
        compiled = [np.asarray(o) for o in outs] + [v.numpy() for v in fresh.values()]
        _compare(compiled, reference, names, "cpu vs interpreter", "cpu", rtol)
    return outcome


def _interpret(graph: Graph, args: list, var_names: dict, variables: dict) -> list[np.ndarray]:
    """Interpret with fresh buffers for the graph's variables (IR name -> initial value)."""
    buffers = {ir_name: np.array(variables[src], copy=True) for ir_name, src in var_names.items()}
    outs = interpret(graph, args, RunContext(buffers))
    return outs + [buffers[ir_name] for ir_name in var_names]


def check_each_pass(
    traced: Graph, args: list, variables: dict, fresh: dict, live_variables: dict, rtol: float
) -> list[str]:
    """Interpret `traced` before and after each registered pass alone; returns the passes checked.

    A pass may append parameters (autodiff adds cotangents); its first results must be unchanged.
    """
    from flowjit.passes.registry import PASSES, get_pass

    get_pass("canonicalize")  # loads the built-in passes
    # IR variable name -> program variable name, matched through the fj.Variable objects.
    var_names = {ir: src for ir, v in live_variables.items() for src, w in fresh.items() if w is v}
    before = _interpret(traced, args, var_names, variables)
    checked = []
    for name in sorted(PASSES):
        if name in STATE_CONVENTION_PASSES and var_names:
            continue
        graph = parse_graph(print_graph(traced))
        try:
            for prerequisite in PREREQUISITES.get(name, ()):
                graph = PASSES[prerequisite](graph)
            graph = PASSES[name](graph)
        except (NotImplementedError, fj.FlowjitError):
            # The pass declines this graph with a named reason (autodiff of fj.while_loop, an op without
            # a VJP rule): a documented limitation, not a wrong answer.
            continue
        verify(graph)
        rng = np.random.default_rng(0)
        extra = [
            rng.uniform(-1, 1, p.type.shape).astype(p.type.dtype.np_dtype) for p in graph.params[len(traced.params) :]
        ]
        after = _interpret(graph, args + extra, var_names, variables)
        n = len(traced.results)
        _compare(
            after[:n] + after[len(graph.results) :],
            before,
            [f"#{i}" for i in range(len(before))],
            f"after pass '{name}' vs before",
            f"pass:{name}",
            rtol,
        )
        checked.append(name)
    return checked


def check_gradients(
    fj_source: str, np_source: str, inputs: dict, finite_differences: bool = True, forward: bool = True
) -> Outcome:
    """Gradient oracles on a smooth float64 program: `fj.grad` of a scalar loss over all outputs,
    interpreted vs compiled, and vs central finite differences of the numpy rendering; with
    `forward`, also `check_forward`."""
    outcome = check_forward(fj_source, inputs) if forward else Outcome()
    fn, _ = _flowjit_function(fj_source, {})
    loss = lambda *xs: sum(fnp.sum(fnp.sin(o)) for o in fn(*xs))  # noqa: E731
    grad_fn = fj.grad(loss, argnums=tuple(range(len(inputs))))
    args = list(inputs.values())
    reference = [np.asarray(x) for x in fj.jit(grad_fn, target="interpreter")(*args)]
    names = [f"d/d{n}" for n in inputs]
    lowered = fj.jit(grad_fn).lower(*args)
    outcome.ops |= all_ops(lowered.graph("traced"))
    executable = compile_if_supported(lowered)
    if executable is not None:
        outcome.compiled = True
        compiled = [np.asarray(x) for x in executable(*args)]
        _compare(compiled, reference, names, "gradient, cpu vs interpreter", "grad-cpu", RTOL["f64"])
    if not finite_differences or "stop_gradient" in fj_source:
        return outcome  # finite differences see through stop_gradient
    env = numpy_ref.namespace()
    exec(compile(np_source, "<fuzz program (numpy)>", "exec"), env)
    np_loss = lambda xs: sum(float(np.sum(np.sin(np.asarray(o, np.float64)))) for o in env["program"](*xs))  # noqa: E731
    h = 1e-6
    for k, name in enumerate(inputs):
        estimate = np.zeros(args[k].shape)
        for i in np.ndindex(args[k].shape):
            plus = [np.array(a, copy=True) for a in args]
            minus = [np.array(a, copy=True) for a in args]
            plus[k][i] += h
            minus[k][i] -= h
            estimate[i] = (np_loss(plus) - np_loss(minus)) / (2 * h)
        scale = max(1.0, float(np.max(np.abs(estimate), initial=0.0)))
        if not np.allclose(reference[k], estimate, rtol=1e-4, atol=1e-4 * scale):
            i = np.unravel_index(np.argmax(np.abs(reference[k] - estimate)), estimate.shape)
            raise Mismatch(
                f"gradient d/d{name}, interpreter vs finite differences: at index {list(i)} "
                f"expected {estimate[i]!r}, found {reference[k][i]!r}",
                "grad-fd",
            )
    return outcome


# Jacobians are compared on programs of at most this many input and output elements each (jacfwd
# and jacrev are vmaps over that many unit vectors; the dot-product identity covers the rest).
JACOBIAN_MAX_ELEMENTS = 24


def check_forward(fj_source: str, inputs: dict) -> Outcome:
    """Forward-mode oracles on a smooth float64 program (one whose VJP `check_gradients` checks
    against finite differences):

    1. `fj.jvp` against `fj.vjp` by the dot-product identity <J t, c> = <t, J^T c>, for a random
       tangent t of the inputs and cotangent c of the outputs, in one jitted function, interpreted;
    2. the same function compiled for the CPU against the interpreter (J t and J^T c);
    3. on small programs, `fj.jacfwd` against `fj.jacrev`, interpreted.
    """
    outcome = Outcome()
    fn, _ = _flowjit_function(fj_source, {})
    args = list(inputs.values())
    outputs = [np.asarray(o) for o in fj.jit(fn, target="interpreter")(*args)]
    n = len(args)
    rng = np.random.default_rng(0)
    tangents = [rng.standard_normal(a.shape) for a in args]
    cotangents = [rng.standard_normal(o.shape) for o in outputs]

    def products(*flat):
        primals, ts, cs = flat[:n], flat[n : 2 * n], flat[2 * n :]
        jt = fj.jvp(fn, primals, ts)[1]
        jtc = fj.vjp(fn, *primals)[1](tuple(cs))
        return (*jt, *jtc)

    flat_args = [*args, *tangents, *cotangents]
    reference = [np.asarray(x) for x in fj.jit(products, target="interpreter")(*flat_args)]
    jt, jtc = reference[: len(outputs)], reference[len(outputs) :]
    terms = [np.vdot(a, c) for a, c in zip(jt, cotangents)], [np.vdot(t, b) for t, b in zip(tangents, jtc)]
    lhs, rhs = sum(terms[0], 0.0), sum(terms[1], 0.0)
    scale = 1.0 + sum(float(np.sum(np.abs(a * c))) for a, c in zip(jt, cotangents))
    if not abs(lhs - rhs) <= 1e-8 * scale:
        raise Mismatch(f"forward mode: <jvp t, c> = {lhs!r} but <t, vjp c> = {rhs!r} (scale {scale:.3g})", "jvp")
    lowered = fj.jit(products).lower(*flat_args)
    outcome.ops = all_ops(lowered.graph("traced"))
    executable = compile_if_supported(lowered)
    if executable is not None:
        outcome.compiled = True
        names = [f"jvp #{i}" for i in range(len(jt))] + [f"vjp d/d{name}" for name in inputs]
        compiled = [np.asarray(x) for x in executable(*flat_args)]
        _compare(compiled, reference, names, "forward mode, cpu vs interpreter", "jvp-cpu", RTOL["f64"])
    small = sum(a.size for a in args) <= JACOBIAN_MAX_ELEMENTS and sum(o.size for o in outputs) <= JACOBIAN_MAX_ELEMENTS
    if small:
        argnums = tuple(range(n))
        forward = fj.jit(fj.jacfwd(fn, argnums=argnums), target="interpreter")(*args)
        reverse = fj.jit(fj.jacrev(fn, argnums=argnums), target="interpreter")(*args)
        for k, (f, r) in enumerate(zip(fj.tree_util.tree_leaves(forward), fj.tree_util.tree_leaves(reverse))):
            assert_close(np.asarray(f), np.asarray(r), f"jacfwd vs jacrev, block {k}", "jacfwd", 1e-9)
    return outcome


def check_program(program, passes: bool = True) -> Outcome:
    """`check_sources` on a generated `Program`."""
    return check_sources(
        program.flowjit_source(), program.numpy_source(), program.inputs, program.variables, passes=passes
    )
