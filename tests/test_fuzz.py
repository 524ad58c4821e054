"""Differential fuzzing, fixed-seed sample: random programs through numpy, the interpreter, the CPU
backend and every pass, plus the permanent regression tests the fuzzer wrote (tests/fuzz/regressions).
`make fuzz` runs the same oracles on random seeds for as long as asked (docs/fuzzing.md)."""

import ast
import glob
import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest
from fuzz import numpy_ref
from fuzz.generator import BUILDERS, NOT_GENERATED, TRANSFORMS, programs, transforms_in
from fuzz.oracles import Mismatch, check_forward, check_gradients, check_program, check_sources
from fuzz.program import Program, Stmt
from fuzz.reproducer import REGRESSIONS_DIR, write_reproducer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flowjit as fj
from flowjit.ir.ops import REGISTRY
from flowjit.passes import registry as pass_registry

# A few hundred programs (~1,000 statements) in well under a minute on 2 cores: compiles are small,
# and the CPU backend's disk cache makes reruns cheaper still.
SAMPLE = settings(
    max_examples=200, derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck)
)


def test_every_registered_op_has_a_builder():
    missing = sorted(set(REGISTRY) - set(BUILDERS) - set(NOT_GENERATED))
    assert not missing, f"ops the fuzzer cannot generate (add a builder in tests/fuzz/generator.py): {missing}"
    stale = sorted((set(BUILDERS) | set(NOT_GENERATED)) - set(REGISTRY))
    assert not stale, f"builders for ops that are not registered: {stale}"
    # Transformations lower to existing ops: their builders are drawn from their own table, never
    # standing in for an op's builder.
    assert not set(TRANSFORMS) & set(REGISTRY)


def _available_transforms() -> set[str]:
    return {name for name, t in TRANSFORMS.items() if t.available()}


def test_fixed_seed_sample():
    seen, compiled, transforms = set(), [], set()

    @SAMPLE
    @given(programs(max_stmts=10))
    def run(program):
        outcome = check_program(program)
        seen.update(outcome.ops)
        compiled.append(outcome.compiled)
        transforms.update(transforms_in(program))

    run()
    assert len(compiled) >= 150, f"only {len(compiled)} programs ran"
    assert len(seen) > len(BUILDERS) // 2
    assert sum(compiled) > len(compiled) // 3, "too few programs reached the CPU backend"
    assert transforms == _available_transforms(), f"transformations checked: {sorted(transforms)}"


def test_fixed_seed_gradient_sample():
    seen, transforms = set(), set()

    @settings(SAMPLE, max_examples=40)
    @given(programs(max_stmts=6, smooth=True))
    def run(program):
        seen.update(check_gradients(program.flowjit_source(), program.numpy_source(), program.inputs).ops)
        transforms.update(transforms_in(program))

    run()
    assert len(seen) > 10, f"the gradient sample exercised only {sorted(seen)}"
    # Forty programs may happen to draw no statement of some transformation: those get programs of
    # their own, so the gradient oracles always meet every one.
    for name in sorted(_available_transforms() - transforms):

        @settings(SAMPLE, max_examples=5)
        @given(programs(max_stmts=4, smooth=True, require=name))
        def run_with(program):
            check_gradients(program.flowjit_source(), program.numpy_source(), program.inputs)
            transforms.update(transforms_in(program))

        run_with()
    assert transforms == _available_transforms(), f"transformations differentiated: {sorted(transforms)}"


def test_forward_oracle_catches_a_wrong_jvp(monkeypatch):
    source = "def program(x0):\n    v0 = M.sin(x0) * x0\n    return (v0, )\n"
    inputs = {"x0": np.linspace(-1, 1, 4)}
    check_forward(source, inputs)
    jvp = fj.jvp
    monkeypatch.setattr(fj, "jvp", lambda f, p, t: (lambda out, jt: (out, tuple(1.001 * x for x in jt)))(*jvp(f, p, t)))
    with pytest.raises(Mismatch, match="forward mode") as info:
        check_forward(source, inputs)
    assert info.value.where == "jvp"


def test_numpy_reference_of_at_updates():
    x = np.arange(5.0)
    # set keeps the last of repeated indices; the others combine them all (JAX's semantics)
    np.testing.assert_array_equal(numpy_ref.at_update(x, ([1, 3, 1],), np.array([7.0, 8, 9]), "set"), [0, 9, 2, 8, 4])
    np.testing.assert_array_equal(numpy_ref.at_update(x, ([1, 1],), np.array([2.0, 3]), "add"), [0, 6, 2, 3, 4])
    np.testing.assert_array_equal(numpy_ref.at_update(x, ([2, 2],), np.array([2.0, 3]), "multiply"), [0, 1, 12, 3, 4])
    # a traced index wraps negatives once and drops what is still out of range
    traced = numpy_ref.at_update(x, (np.array([-1, 5, -7, 0]),), np.array(1.0), "add", traced=True)
    np.testing.assert_array_equal(traced, [1, 1, 2, 3, 5])
    m = np.zeros((3, 2))
    np.testing.assert_array_equal(
        numpy_ref.at_update(m, np.s_[::-1, 1], np.array([1.0, 2, 3]), "max"), [[0, 3], [0, 2], [0, 1]]
    )


def _regressions():
    """One param per reproducer; those that set `XFAIL = "symptom"` are strict xfails."""
    params = []
    for path in sorted(glob.glob(os.path.join(REGRESSIONS_DIR, "*.py"))):
        tree = ast.parse(open(path, encoding="utf-8").read())
        reason = next(
            (
                node.value.value
                for node in tree.body
                if isinstance(node, ast.Assign) and [getattr(t, "id", "") for t in node.targets] == ["XFAIL"]
            ),
            None,
        )
        marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
        params.append(pytest.param(path, marks=marks, id=os.path.basename(path)[:-3]))
    return params


@pytest.mark.parametrize("path", _regressions())
def test_regression(path):
    spec = importlib.util.spec_from_file_location("fuzz_regression_" + os.path.basename(path)[:-3], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.check()


def _tiny_program(np_expr: str = "C(np.tanh(W(x0)) * 2, 'f32')") -> Program:
    p = Program()
    p.inputs["x0"] = np.linspace(-2, 2, 6, dtype=np.float32).reshape(2, 3)
    p.stmts.append(Stmt("v0", "M.tanh(x0) * 2", np_expr))
    p.outputs.append("v0")
    return p


def test_oracles_catch_a_wrong_reference():
    with pytest.raises(Mismatch, match="interpreter vs numpy, output #0"):
        check_program(_tiny_program("C(np.tanh(W(x0)) * 2.01, 'f32')"))


def test_each_pass_oracle_names_a_wrong_pass(monkeypatch):
    def wrong_pass(graph):
        for op in graph.ops:
            if op.name == "mul":
                op.name = "add"
        return graph

    pass_registry.get_pass("canonicalize")
    monkeypatch.setitem(pass_registry.PASSES, "fuzz-wrong-pass", wrong_pass)
    with pytest.raises(Mismatch, match="after pass 'fuzz-wrong-pass'") as info:
        check_program(_tiny_program())
    assert info.value.where == "pass:fuzz-wrong-pass"


def test_reproducer_runs_standalone(tmp_path):
    program = _tiny_program()
    good = write_reproducer(program, "a passing program", "cpu", str(tmp_path))
    assert open(good[:-3] + ".fj").read().startswith("// stage: traced")
    env = {**os.environ, "FLOWJIT_TESTS_DIR": os.path.dirname(os.path.abspath(__file__))}
    result = subprocess.run([sys.executable, good], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0 and "all oracles agree" in result.stdout, result.stderr
    bad = write_reproducer(_tiny_program("C(np.tanh(W(x0)), 'f32')"), "a wrong reference", "numpy", str(tmp_path))
    result = subprocess.run([sys.executable, bad], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode != 0 and "Mismatch" in result.stderr


@given(st.data())
@settings(max_examples=5, deadline=None, database=None, derandomize=True)
def test_sources_round_trip_through_the_reproducer(data):
    program = data.draw(programs(max_stmts=4))
    namespace = {"__file__": os.path.join(REGRESSIONS_DIR, "round_trip.py")}
    exec(program.reproducer("round trip"), namespace)
    for name, array in program.inputs.items():
        np.testing.assert_array_equal(namespace["INPUTS"][name], array)
        assert namespace["INPUTS"][name].dtype == array.dtype
    check_sources(namespace["FLOWJIT_SOURCE"], namespace["NUMPY_SOURCE"], namespace["INPUTS"], namespace["VARIABLES"])
