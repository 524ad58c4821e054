"""The `flowjit` command: `opt` and `dump` outputs, and every user error as one `flowjit: error:` line
with exit status 1 and no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from flowjit.backends import default_target
from flowjit.cli import UsageError, main, parse_arg_spec, parse_static
from flowjit.ir import dtypes as dt
from flowjit.passes.registry import PASSES

FLOWJIT = os.path.join(os.path.dirname(sys.executable), "flowjit")

MODEL = """\
from __future__ import annotations

import dataclasses

import flowjit as fj
import flowjit.numpy as fnp


def predict(x, w, n=2):
    y = fnp.tanh(x @ w)
    for _ in range(n):
        y = y * 1.0
    return y.sum(axis=1)


def mismatch(x, w):
    return x @ w


def crash(x):
    return x + missing_name


def pick(x, mode):
    return x.sum() if mode == "sum" else x.max()


@fj.jit(static_argnums=1)
def scaled(x, k):
    return x * k


def flags(x, *, scale):
    return x * scale


@dataclasses.dataclass(frozen=True)
class Config:
    scale: float = 2.0


def configured(x):
    return x * Config().scale
"""

IR = """\
func @f(%x: tensor<4xf32>) -> (tensor<4xf32>) {
  %0 = constant {value = array<tensor<4xf32>, 1.0>} : tensor<4xf32>
  %1 = mul %x, %0 : tensor<4xf32> loc("m.py":2)
  %2 = exp %x : tensor<4xf32> loc("m.py":3)
  %3 = exp %x : tensor<4xf32> loc("m.py":4)
  %4 = add %2, %3 : tensor<4xf32> loc("m.py":5)
  %5 = sub %4, %1 : tensor<4xf32> loc("m.py":6)
  return %5 : tensor<4xf32>
}
"""


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "model.py"
    path.write_text(MODEL)
    return str(path)


def run(argv, capsys):
    """Run the command in-process; returns (exit status, stdout, stderr)."""
    status = main(argv)
    out, err = capsys.readouterr()
    return status, out, err


def assert_user_error(status, out, err, *fragments):
    assert status == 1 and out == ""
    assert err.startswith("flowjit: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, err


# --- opt -----------------------------------------------------------------------------------------------


def test_opt_without_passes_round_trips(tmp_path, capsys):
    path = tmp_path / "in.fj"
    path.write_text("// a header comment is not part of the IR\n" + IR)
    status, out, err = run(["opt", str(path)], capsys)
    assert (status, out, err) == (0, IR, "")


def test_opt_runs_canonicalize(tmp_path, capsys):
    path = tmp_path / "in.fj"
    path.write_text(IR)
    status, out, _ = run(["opt", str(path), "-p", "canonicalize"], capsys)
    assert status == 0
    assert out == textwrap.dedent("""\
        func @f(%x: tensor<4xf32>) -> (tensor<4xf32>) {
          %0 = exp %x : tensor<4xf32> loc("m.py":3)
          %1 = add %0, %0 : tensor<4xf32> loc("m.py":5)
          %2 = sub %1, %x : tensor<4xf32> loc("m.py":6)
          return %2 : tensor<4xf32>
        }
        """)


def test_opt_reads_stdin_through_the_installed_command():
    proc = subprocess.run(
        [FLOWJIT, "opt", "-", "-p", "canonicalize,canonicalize"], input=IR, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("exp %x") == 1


def test_opt_errors(tmp_path, capsys):
    bad = tmp_path / "bad.fj"
    bad.write_text(IR.replace("%3 = exp %x", "%3 = exp %y"))
    assert_user_error(*run(["opt", str(bad)], capsys), f"{bad}:5:12: use of undefined value %y")
    assert_user_error(*run(["opt", str(tmp_path / "none.fj")], capsys), "cannot read text IR file", "none.fj")
    assert_user_error(*run(["opt", str(bad), "-p", "fuse-everything"], capsys), "unknown pass 'fuse-everything'")


def test_version_and_usage_errors(capsys):
    proc = subprocess.run([FLOWJIT, "--version"], capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout.strip()) == (0, "flowjit 0.1.0")
    assert_user_error(*run([], capsys), "required: COMMAND")
    assert_user_error(*run(["frobnicate"], capsys), "invalid choice: 'frobnicate'")
    assert_user_error(*run(["opt"], capsys), "required: file", "flowjit opt --help")


# --- dump ----------------------------------------------------------------------------------------------


def test_dump_traced_with_static_argument(model, capsys):
    status, out, err = run(
        ["dump", f"{model}:predict", "--arg", "f32[4,8]", "--arg", "f32[8,2]", "--static", "n=1", "--stage", "traced"],
        capsys,
    )
    assert (status, err) == (0, "")
    assert out.startswith(
        "// stage: traced\nfunc @predict(%x: tensor<4x8xf32>, %w: tensor<8x2xf32>) -> (tensor<4xf32>) {"
    )
    assert out.count(" mul ") == 1 and "reduce_sum" in out


def test_dump_optimized_is_the_default(model, capsys):
    status, out, _ = run(
        ["dump", f"{model}:predict", "--arg", "f32[4,8]", "--arg", "f32[8,2]", "--static", "n=3"], capsys
    )
    assert status == 0
    assert "// stage: optimized" in out and "pipeline: canonicalize" in out
    assert " mul " not in out  # y * 1.0 is gone


def test_dump_all_stages(model, capsys):
    status, out, _ = run(
        ["dump", f"{model}:pick", "--arg", "i64[5]", "--static", "mode='max'", "--stage", "all"], capsys
    )
    assert status == 0
    assert "// stage: traced" in out and "// stage: optimized" in out and "reduce_max" in out
    if default_target() == "cpu":  # every backend stage is printed, each under its own header
        assert "\n// stage: mlir\n" in out and "\n// stage: llvm\n" in out and "\n// stage: asm\n" in out


def test_dump_a_function_already_under_jit(model, capsys):
    status, out, _ = run(
        ["dump", f"{model}:scaled", "--arg", "bf16[3]", "--static", "k=2", "--stage", "traced"], capsys
    )
    assert status == 0 and "func @scaled(%x: tensor<3xbf16>)" in out


def test_dump_a_module_with_a_dataclass(model, capsys):
    status, out, _ = run(["dump", f"{model}:configured", "--arg", "f32[2]", "--stage", "traced"], capsys)
    assert status == 0 and "[2.0]" in out


def test_dump_keyword_only_static(model, capsys):
    status, out, _ = run(
        ["dump", f"{model}:flags", "--arg", "f64[2,2]", "--static", "scale=0.5", "--stage", "traced"], capsys
    )
    assert status == 0 and "[0.5]" in out


@pytest.mark.parametrize(
    "argv, fragments",
    [
        (["--arg", "f32[4,8]", "--arg", "f32[9,2]"], ["tracing", "model.py:mismatch failed", "model.py:17", "matmul"]),
        (["--arg", "q8[4]"], ["--arg 'q8[4]': unknown dtype 'q8'", "f32"]),
        (["--arg", "f32[4,-1]"], ["dimensions must be non-negative integers", "[4,-1]"]),
        (["--arg", "f32(4)"], ["--arg 'f32(4)': expected DTYPE[D0,D1,...]"]),
        (["--static", "k"], ["--static 'k': expected NAME=VALUE"]),
        (["--static", "k=banana"], ["'banana' is not a Python literal"]),
    ],
)
def test_dump_argument_errors(model, capsys, argv, fragments):
    assert_user_error(*run(["dump", f"{model}:mismatch", *argv], capsys), *fragments)


def test_dump_trace_failure_names_the_user_line(model, capsys):
    assert_user_error(
        *run(["dump", f"{model}:crash", "--arg", "f32[3]"], capsys),
        "model.py:crash failed at",
        "model.py:21: NameError: name 'missing_name' is not defined",
    )


def test_dump_file_and_function_errors(model, tmp_path, capsys):
    assert_user_error(
        *run(["dump", f"{model}:nothere", "--arg", "f32[3]"], capsys), "has no function 'nothere'", "crash"
    )
    assert_user_error(*run(["dump", f"{tmp_path}/none.py:f"], capsys), "cannot read Python file", "none.py")
    assert_user_error(*run(["dump", "model.py"], capsys), "expected FILE.py:FUNCTION", "found 'model.py'")
    broken = tmp_path / "broken.py"
    broken.write_text("x = 1\ndef f(:\n")
    assert_user_error(*run(["dump", f"{broken}:f"], capsys), "importing", "broken.py:2", "SyntaxError")


def test_dump_signature_errors(model, capsys):
    assert_user_error(
        *run(["dump", f"{model}:mismatch", "--arg", "f32[2]", "--arg", "f32[2]", "--arg", "f32[2]"], capsys),
        "mismatch(x, w) takes 2 array argument(s) (x, w); found 3 --arg",
    )
    assert_user_error(
        *run(["dump", f"{model}:mismatch", "--arg", "f32[2]", "--static", "z=1"], capsys), "has no parameter 'z'"
    )
    assert_user_error(
        *run(["dump", f"{model}:pick", "--arg", "f32[4]", "--static", "mode=1", "--stage", "ptx"], capsys),
        "--stage ptx: expected all or a stage of this compilation",
    )


def test_dump_through_the_installed_command_has_no_traceback(model):
    proc = subprocess.run(
        [FLOWJIT, "dump", f"{model}:crash", "--arg", "f32[3]"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.startswith("flowjit: error: tracing") and "Traceback" not in proc.stderr


# --- argument grammar ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, shape, dtype",
    [
        ("f32[256,784]", (256, 784), dt.float32),
        ("i64[]", (), dt.int64),
        ("bf16[ 2, 3 ]", (2, 3), dt.bfloat16),
        ("bool[0]", (0,), dt.bool_),
    ],
)
def test_parse_arg_spec(spec, shape, dtype):
    sd = parse_arg_spec(spec)
    assert sd.shape == shape and sd.dtype == dtype.np_dtype


@pytest.mark.parametrize("spec", ["f32", "float32[2]", "f32[2", "f32[2.5]", "f32[a]", "[2]"])
def test_parse_arg_spec_rejects(spec):
    with pytest.raises(UsageError, match="--arg"):
        parse_arg_spec(spec)


def test_parse_static():
    assert parse_static("n=3") == ("n", 3)
    assert parse_static("shape=(2, 3)") == ("shape", (2, 3))
    assert parse_static("mode='sum'") == ("mode", "sum")
    with pytest.raises(UsageError):
        parse_static("2x=1")


def test_opt_names_the_pass_that_broke_the_ir(tmp_path, capsys, monkeypatch):
    def drop_first_op(graph):
        graph.ops = graph.ops[1:]
        return graph

    monkeypatch.setitem(PASSES, "drop-first-op", drop_first_op)
    path = tmp_path / "in.fj"
    path.write_text(IR)
    monkeypatch.setenv("FLOWJIT_DUMP_DIR", str(tmp_path / "dump"))
    assert_user_error(
        *run(["opt", str(path), "-p", "canonicalize,drop-first-op"], capsys),
        "invalid IR after pass 'drop-first-op'",
        "operand 0 (tensor<4xf32>) is not defined before it",
    )
    dumped = sorted(os.listdir(tmp_path / "dump"))
    assert dumped[-1].endswith("-f-drop-first-op.fj")  # the broken IR is there to look at
