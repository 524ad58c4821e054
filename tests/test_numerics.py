"""The reference interpreter against the op table's independent numpy references, for every row;
each table graph also verifies and round-trips through the text IR."""

import pytest
from op_table import assert_close, cases, fresh_variables, ops_with_rows

from flowjit.errors import FlowjitTypeError
from flowjit.ir.builder import emit
from flowjit.ir.graph import Graph
from flowjit.ir.interpreter import RunContext, interpret
from flowjit.ir.ops import REGISTRY
from flowjit.ir.parser import parse_graph
from flowjit.ir.printer import print_graph
from flowjit.ir.types import TensorType
from flowjit.ir.verifier import verify

CASES = list(cases())


def test_every_registered_op_has_a_row():
    missing = sorted(set(REGISTRY) - ops_with_rows())
    assert not missing, f"ops without a row in tests/op_table.py (add one per new op): {', '.join(missing)}"


def test_case_ids_are_unique():
    ids = [case_id for case_id, _ in CASES]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("case", [c for _, c in CASES], ids=[i for i, _ in CASES])
def test_interpreter_matches_reference(case):
    verify(case.graph)
    text = print_graph(case.graph)
    assert print_graph(parse_graph(text)) == text, "print -> parse -> print is not the identity"
    before = [a.copy() for a in case.inputs]
    outputs = interpret(case.graph, case.inputs, RunContext(fresh_variables(case.graph)))
    assert len(outputs) == len(case.expected)
    for i, (actual, expected) in enumerate(zip(outputs, case.expected)):
        assert_close(actual, expected, case.tol, f"result {i} of\n{print_graph(case.graph)}")
    for a, b in zip(case.inputs, before):
        assert a.tobytes() == b.tobytes(), "the op wrote into its input"


@pytest.mark.parametrize(
    "op, types, attrs, message",
    [
        ("gather", [((0,), "f32"), ((2,), "i32")], {"axis": 0}, "size 0"),
        ("gather", [((3,), "f32"), ((2,), "f32")], {"axis": 0}, "integers"),
        ("add", [((3,), "f32"), ((3,), "f16")], {}, "equal dtypes"),
        ("slice", [((3,), "f32")], {"start": (2,), "limit": (1,), "stride": (1,)}, "start <= limit"),
        ("dynamic_slice", [((3,), "f32"), ((), "i32")], {"sizes": (4,)}, "exceeds"),
        ("argmax", [((0, 2), "f32")], {"axis": 0, "index_dtype": "i64"}, "size 0"),
        (
            "reduce_window",
            [((2,), "f32")],
            {"kind": "max", "window": (3,), "strides": (1,), "padding": ((0, 0),)},
            "larger",
        ),
    ],
)
def test_shape_rules_reject_bad_operands(op, types, attrs, message):
    graph = Graph(op)
    params = [graph.add_param(TensorType(shape, dtype)) for shape, dtype in types]
    with pytest.raises(FlowjitTypeError, match=f"op '{op}'.*{message}"):
        emit(graph, op, params, attrs)
