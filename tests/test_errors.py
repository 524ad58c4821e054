"""Every mistake a user can make is a `flowjit.FlowjitError` (a TypeError or ValueError where that
fits) whose message starts with the user's `file:line` and names the op, what was expected and what
was found; the traceback shows the user's frames and at most one flowjit frame (the jit wrapper, or
`Jitted.__call__`, which does the wrapper's work itself)."""

import os
import re

import numpy as np
import pytest

import flowjit as fj
import flowjit.numpy as fnp
from flowjit.errors import TracerControlFlowError
from flowjit.ir.location import is_internal_file


def line_of(marker: str) -> int:
    """The line of this file ending with the comment `# marker`."""
    with open(__file__) as f:
        lines = [i for i, text in enumerate(f, 1) if text.rstrip().endswith(f"# {marker}")]
    assert len(lines) == 1, marker
    return lines[0]


def check(excinfo, cls, marker: str, *fragments: str) -> str:
    """The error is a `cls`, names this file at the marked line, contains every fragment, and its
    traceback hides flowjit's frames. Returns the message."""
    error = excinfo.value
    assert isinstance(error, cls) and isinstance(error, fj.FlowjitError), type(error)
    message = str(error)
    where = re.match(r"(.+?):(\d+): ", message)
    assert where, message
    assert os.path.samefile(where.group(1), __file__) and int(where.group(2)) == line_of(marker), message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    internal = []
    tb = error.__traceback__
    user_lines = []
    while tb is not None:
        code = tb.tb_frame.f_code
        if is_internal_file(code.co_filename):
            internal.append(code.co_name)
        elif os.path.samefile(code.co_filename, __file__):
            user_lines.append(tb.tb_lineno)
        tb = tb.tb_next
    assert internal in ([], ["wrapper"], ["__call__"]), internal
    assert line_of(marker) in user_lines, user_lines
    assert error.__cause__ is None and error.__suppress_context__
    return message


# --- shapes and attributes ---------------------------------------------------------------------------


def test_matmul_shape_mismatch():
    f = fj.jit(lambda x, w: x @ w)  # err-matmul
    with pytest.raises(fj.FlowjitTypeError) as e:
        f(np.ones((256, 784), np.float32), np.ones((100, 10), np.float32))
    assert isinstance(e.value, TypeError)
    check(e, fj.FlowjitTypeError, "err-matmul", "op 'matmul'", "(256, 784)", "(100, 10)", "784 != 100")


def test_broadcasting_mismatch_in_add():
    @fj.jit
    def f(x, b):
        return x + b  # err-add

    with pytest.raises(fj.FlowjitTypeError) as e:
        f(np.ones((3, 4), np.float32), np.ones(5, np.float32))
    check(e, fj.FlowjitTypeError, "err-add", "op 'add'", "broadcast", "(3, 4)", "(5,)")


def test_reshape_to_a_wrong_size():
    @fj.jit
    def f(x):
        return x.reshape(5, 5)  # err-reshape

    with pytest.raises(fj.FlowjitTypeError) as e:
        f(np.ones((3, 4), np.float32))
    check(e, fj.FlowjitTypeError, "err-reshape", "op 'reshape'", "(3,4)", "12 elements", "(5,5)")


def test_bad_axis_in_a_method():
    @fj.jit
    def f(x):
        return x.sum(axis=2)  # err-axis-method

    with pytest.raises(fj.FlowjitValueError) as e:
        f(np.ones((3, 4), np.float32))
    assert isinstance(e.value, ValueError)
    check(e, fj.FlowjitValueError, "err-axis-method", "op 'reduce'", "axis 2", "rank 2")


def test_bad_negative_axis_in_a_function():
    @fj.jit
    def f(x):
        return fnp.max(x, axis=-3)  # err-axis-function

    with pytest.raises(fj.FlowjitValueError) as e:
        f(np.ones((3, 4), np.float32))
    check(e, fj.FlowjitValueError, "err-axis-function", "axis -3", "rank 2")


# --- Python control flow and conversions on traced values ------------------------------------------


def test_python_if_on_a_traced_value():
    @fj.jit
    def f(x):
        if x.sum() > 0:  # err-if
            return x
        return -x

    with pytest.raises(TracerControlFlowError) as e:
        f(np.ones(3, np.float32))
    check(e, fj.FlowjitTypeError, "err-if", "fj.cond", "fnp.where")


def test_python_while_on_a_traced_value():
    @fj.jit
    def f(x):
        while x.sum() > 0:  # err-while
            x = x - 1
        return x

    with pytest.raises(TracerControlFlowError) as e:
        f(np.ones(3, np.float32))
    check(e, fj.FlowjitTypeError, "err-while", "fj.while_loop", "fj.fori_loop")


def test_python_and_on_a_traced_value():
    @fj.jit
    def f(x, y):
        return (x > 0) and (y > 0)  # err-and

    with pytest.raises(TracerControlFlowError) as e:
        f(np.ones(3, np.float32), np.ones(3, np.float32))
    check(e, fj.FlowjitTypeError, "err-and", "`and`/`or`", "fj.cond")


def test_int_of_a_traced_value():
    @fj.jit
    def f(x):
        return fnp.zeros(int(x))  # err-int

    with pytest.raises(TracerControlFlowError) as e:
        f(np.float32(3))
    check(e, fj.FlowjitTypeError, "err-int", "int()", "static_argnums")


def test_np_asarray_of_a_traced_value():
    @fj.jit
    def f(x):
        return np.asarray(x) + 1  # err-asarray

    with pytest.raises(TracerControlFlowError) as e:
        f(np.ones(3, np.float32))
    check(e, fj.FlowjitTypeError, "err-asarray", "np.asarray", "flowjit.numpy")


LEAKED = []


def test_traced_value_leaked_to_a_global_and_reused():
    @fj.jit
    def leak(x):
        LEAKED.append(x * 2)
        return x

    @fj.jit
    def reuse(x):
        return x + LEAKED[0]  # err-leak

    leak(np.ones(3, np.float32))
    with pytest.raises(fj.FlowjitTypeError) as e:
        reuse(np.ones(3, np.float32))
    check(e, fj.FlowjitTypeError, "err-leak", "escaped the function that created it", "pass it in as an argument")
    with pytest.raises(fj.FlowjitTypeError, match="escaped"):
        fj.jit(lambda x: x)(LEAKED[0])
    with pytest.raises(fj.FlowjitTypeError, match="escaped"):
        fnp.sin(LEAKED[0])
    LEAKED.clear()


# --- arguments, results, static arguments ----------------------------------------------------------


def test_string_argument_names_its_path():
    f = fj.jit(lambda batch: batch["x"] * 2)
    with pytest.raises(fj.FlowjitTypeError) as e:
        f({"x": "not an array"})  # err-str
    check(e, fj.FlowjitTypeError, "err-str", "argument batch['x']", "found str", "static_argnums")


@pytest.mark.parametrize(
    "dtype, fix",
    [
        (np.complex64, "x[1].real and x[1].imag"),
        (np.uint8, "x[1].astype(np.int32)"),
        (np.int16, "x[1].astype(np.int32)"),
    ],
)
def test_unsupported_argument_dtype_is_an_error_with_the_fix(dtype, fix):
    f = fj.jit(lambda x: x[0] + x[1])
    with pytest.raises(fj.FlowjitTypeError) as e:
        f((np.ones(3, np.float32), np.ones(3, dtype)))  # err-dtype
    check(e, fj.FlowjitTypeError, "err-dtype", f"unsupported dtype {np.dtype(dtype).name}", "float32", fix)


def test_unsupported_constant_dtype_in_a_traced_function():
    table = np.ones(3, np.complex64)

    @fj.jit
    def add(x):
        return x + table  # err-const

    with pytest.raises(fj.FlowjitTypeError) as e:
        add(np.ones(3, np.float32))
    check(e, fj.FlowjitTypeError, "err-const", "complex64")

    @fj.jit  # err-const-return
    def ret(x):
        return x, table

    with pytest.raises(fj.FlowjitTypeError) as e:
        ret(np.ones(3, np.float32))
    message = str(e.value)
    assert message.startswith(f"{__file__}:{line_of('err-const-return')}: "), message
    assert "returned an array of dtype complex64 at output[1]" in message


def test_unhashable_static_argument_names_the_argument():
    f = fj.jit(lambda x, sizes: x.reshape(sizes), static_argnums=1)
    with pytest.raises(fj.FlowjitTypeError) as e:
        f(np.ones(6, np.float32), [2, 3])  # err-static
    message = check(e, fj.FlowjitTypeError, "err-static", "static argument 'sizes'", "hashable", "found list")
    assert "id(" not in message


def test_wrong_number_of_arguments():
    f = fj.jit(lambda x, w: x @ w)
    with pytest.raises(fj.FlowjitTypeError) as e:
        f(np.ones((2, 2), np.float32))  # err-arity
    check(e, fj.FlowjitTypeError, "err-arity", "missing a required argument: 'w'")


def test_returning_a_non_array():
    @fj.jit  # err-return
    def f(x):
        return {"y": x, "name": "not an array"}

    with pytest.raises(fj.FlowjitTypeError) as e:
        f(np.ones(3, np.float32))
    message = str(e.value)
    assert message.startswith(f"{__file__}:{line_of('err-return')}: "), message
    assert "returned a str at output['name']" in message


def test_bad_jit_options():
    with pytest.raises(fj.FlowjitValueError) as e:
        fj.jit(lambda x: x, static_argnums=3)  # err-argnums
    check(e, fj.FlowjitValueError, "err-argnums", "static_argnums 3 is out of range")
    with pytest.raises(fj.FlowjitValueError, match="static_argnames 'n' is not a parameter"):
        fj.jit(lambda x: x, static_argnames="n")
    with pytest.raises(fj.FlowjitTypeError, match="jit expects a function; found int"):
        fj.jit(3)
    with pytest.raises(fj.FlowjitTypeError, match="unsupported dtype"):
        fj.ShapeDtype((2,), np.complex128)
    for shape in [(2, -1), ("a",), (2.0,)]:
        with pytest.raises(fj.FlowjitValueError, match="a shape is a tuple of non-negative ints"):
            fj.ShapeDtype(shape, np.float32)


def test_stage_and_signature_errors_on_lowered_functions():
    lo = fj.jit(lambda x: x + 1).lower(np.ones(3, np.float32))
    with pytest.raises(fj.FlowjitValueError) as e:
        lo.as_text("nope")  # err-stage
    check(e, fj.FlowjitValueError, "err-stage", "no stage 'nope'", "available: traced, optimized")
    with pytest.raises(fj.FlowjitTypeError) as e:
        lo.compile()(np.ones(4, np.float32))  # err-compiled
    check(e, fj.FlowjitTypeError, "err-compiled", "argument x changed from tensor<3xf32> to tensor<4xf32>")


def test_error_inside_an_inlined_jit_shows_both_user_frames():
    @fj.jit
    def inner(x):
        return x.reshape(7)  # err-inner

    @fj.jit
    def outer(x):
        return inner(x * 2)  # err-outer-call

    with pytest.raises(fj.FlowjitTypeError) as e:
        outer(np.ones(6, np.float32))
    check(e, fj.FlowjitTypeError, "err-inner", "op 'reshape'")
    tb, lines = e.value.__traceback__, []
    while tb is not None:
        lines.append(tb.tb_lineno)
        tb = tb.tb_next
    assert line_of("err-outer-call") in lines


def test_item_and_tolist_of_a_traced_value():
    @fj.jit
    def f(x):
        return fnp.zeros(3) + x.sum().item()  # err-item

    with pytest.raises(TracerControlFlowError) as e:
        f(np.ones(3, np.float32))
    check(e, fj.FlowjitTypeError, "err-item", "item()")


def test_assigning_into_a_traced_value():
    @fj.jit
    def f(x):
        x[0] = 1.0  # err-setitem
        return x

    with pytest.raises(fj.FlowjitTypeError) as e:
        f(np.ones(3, np.float32))
    check(e, fj.FlowjitTypeError, "err-setitem", "immutable", "x = x.at[...].set(v)")


def test_unknown_attribute_of_a_traced_value():
    seen = {}

    @fj.jit
    def f(x):
        seen["hasattr"] = hasattr(x, "no_such_method")
        return x.no_such_method()  # err-attr

    with pytest.raises(AttributeError) as e:
        f(np.ones(3, np.float32))
    assert seen["hasattr"] is False
    check(e, fj.FlowjitError, "err-attr", "no attribute 'no_such_method'", "flowjit.numpy")


def test_results_too_big_for_memory_are_a_flowjit_error_naming_the_call():
    f = fj.jit(lambda: fnp.zeros((1 << 20, 1 << 20)))  # 4 TiB of float32
    with pytest.raises(fj.FlowjitMemoryError, match=r"test_errors.py:\d+: lambda: out of memory .* 4.00 TiB"):
        f()
