"""`flowjit check FILE.py:FN --arg ...`: every stage against the reference interpreter; the first
stage that changes the result is named with the op and the user's source line."""

import re
import sys
import textwrap

import numpy as np
import pytest

from flowjit import backends, cli
from flowjit.backends.interpreter import InterpreterExecutable
from flowjit.passes import registry

MODEL = """\
import numpy as np
import flowjit as fj
import flowjit.numpy as fnp

state = fj.Variable(np.zeros(3, np.float32), name="check_state")


def predict(x, w):
    h = fnp.tanh(x @ w)
    return fnp.sum(h * 2.0, axis=1), fnp.exp(h)


def loop(x):
    return fj.fori_loop(0, 3, lambda i, c: c * 0.5 + 1.0, x)


def step(x):
    state.assign_add(x.sum(axis=0))
    return state.value * 2.0
"""


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "model.py"
    path.write_text(textwrap.dedent(MODEL))
    return str(path)


def test_all_stages_agree(model, capsys):
    assert cli.main(["check", f"{model}:predict", "--arg", "f32[4,8]", "--arg", "f32[8,3]"]) == 0
    out = capsys.readouterr().out
    for stage in ("traced (reference)", "pass 'canonicalize'", "compiled (cpu)"):
        assert stage in out
    assert "every stage agrees" in out


def test_names_the_pass_and_source_line(model, capsys, monkeypatch):
    real = registry.get_pass("canonicalize")

    def wrong_canonicalize(graph):
        graph = real(graph)
        for op in graph.ops:
            if op.name == "mul":
                op.name = "add"  # same types, wrong values
        return graph

    monkeypatch.setitem(registry.PASSES, "canonicalize", wrong_canonicalize)
    assert cli.main(["check", f"{model}:predict", "--arg", "f32[4,8]", "--arg", "f32[8,3]"]) == 1
    out = capsys.readouterr().out
    assert re.search(r"pass 'canonicalize' +MISMATCH: result 0", out)
    assert "result: pass 'canonicalize' changes the result (op 'reduce_sum' at " in out
    assert "model.py:10)" in out
    assert "compiled" not in out  # later stages are not blamed


def test_names_the_backend(model, capsys, monkeypatch):
    class WrongExecutable(InterpreterExecutable):
        def run(self, args, variables=None):
            return [o + 1 for o in super().run(args, variables)]

    class WrongBackend(backends.Backend):
        name = "cpu"

        def compile(self, graph, device=None, options=None, aliases=None):
            return WrongExecutable(graph)

    monkeypatch.setitem(backends.BACKENDS, "cpu", WrongBackend())
    assert cli.main(["check", f"{model}:predict", "--arg", "f32[4,8]", "--arg", "f32[8,3]"]) == 1
    out = capsys.readouterr().out
    assert re.search(r"compiled \(cpu\) +MISMATCH: result 0", out)
    assert "result: compiled (cpu) changes the result" in out


def test_variables_are_checked_and_left_unchanged(model, capsys):
    assert cli.main(["check", f"{model}:step", "--arg", "f32[2,3]"]) == 0
    assert "every stage agrees" in capsys.readouterr().out
    module = next(m for name, m in sys.modules.items() if name.startswith("_flowjit_user_model"))
    np.testing.assert_array_equal(module.state.numpy(), np.zeros(3, np.float32))


def test_a_missing_lowering_is_skipped_not_blamed(model, capsys, monkeypatch):
    from flowjit.backends.mlir.target import no_lowering_error

    class WithoutFor(backends.Backend):
        name = "cpu"

        def compile(self, graph, device=None, options=None, aliases=None):
            op = next(op for op in graph.ops if op.name != "constant")
            raise no_lowering_error(op, "cpu")

    monkeypatch.setitem(backends.BACKENDS, "cpu", WithoutFor())
    assert cli.main(["check", f"{model}:loop", "--arg", "f32[3]"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"compiled \(cpu\) +skipped: .*has no lowering for target 'cpu'", out)


def test_bad_argument_is_a_user_error(model, capsys):
    assert cli.main(["check", f"{model}:predict", "--arg", "f32[4,x]"]) == 1
    assert "flowjit: error: --arg 'f32[4,x]'" in capsys.readouterr().err
