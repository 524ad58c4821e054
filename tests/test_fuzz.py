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
from fuzz.generator import BUILDERS, NOT_GENERATED, programs
from fuzz.oracles import Mismatch, check_gradients, check_program, check_sources
from fuzz.program import Program, Stmt
from fuzz.reproducer import REGRESSIONS_DIR, write_reproducer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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


def test_fixed_seed_sample():
    seen, compiled = set(), []

    @SAMPLE
    @given(programs(max_stmts=10))
    def run(program):
        outcome = check_program(program)
        seen.update(outcome.ops)
        compiled.append(outcome.compiled)

    run()
    assert len(compiled) >= 150, f"only {len(compiled)} programs ran"
    assert len(seen) > len(BUILDERS) // 2
    assert sum(compiled) > len(compiled) // 3, "too few programs reached the CPU backend"


def test_fixed_seed_gradient_sample():
    seen = set()

    @settings(SAMPLE, max_examples=40)
    @given(programs(max_stmts=6, smooth=True))
    def run(program):
        seen.update(check_gradients(program.flowjit_source(), program.numpy_source(), program.inputs).ops)

    run()
    assert len(seen) > 10, f"the gradient sample exercised only {sorted(seen)}"


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
