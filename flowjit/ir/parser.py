"""Parser for the text IR written by `printer.py` (the input of `flowjit opt` and the lit tests).

Besides the syntax, each op is checked as it is read (registered op, its attributes, its declared
result types against its shape rule), so a mistake in hand-written IR is reported at its line.
Errors are `FlowjitValueError`s naming `file:line:col`, what was expected there and what was found.
"""

from __future__ import annotations

import json
import re

import numpy as np

from flowjit.errors import FlowjitError, FlowjitValueError
from flowjit.ir import dtypes as dt
from flowjit.ir.builder import make_op
from flowjit.ir.graph import Graph, Op, Value
from flowjit.ir.location import UNKNOWN, Location
from flowjit.ir.types import TensorType
from flowjit.ir.verifier import check_op

_TOKEN_RE = re.compile(
    r"""
    (?P<ws>[ \t\r\n]+|//[^\n]*)
  | (?P<type>tensor<(?:\d+x)*[a-z][a-z0-9]*>)
  | (?P<value>%[A-Za-z0-9_.$]+(?:[:#]\d+)?)
  | (?P<symbol>@[A-Za-z0-9_.$]+)
  | (?P<block>\^[A-Za-z0-9_.$]+)
  | (?P<string>"(?:[^"\\]|\\.)*")
  | (?P<hex>0x[0-9a-fA-F]*)
  | (?P<number>(?:-?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|inf)|nan)(?![A-Za-z0-9_]))
  | (?P<ident>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<arrow>->)
  | (?P<punct>[(){}\[\]<>,:=])
    """,
    re.VERBOSE,
)


class _Token:
    __slots__ = ("kind", "text", "line", "col")

    def __init__(self, kind, text, line, col):
        self.kind, self.text, self.line, self.col = kind, text, line, col


def _tokenize(text: str, filename: str) -> list[_Token]:
    tokens, pos, line, line_start = [], 0, 1, 0
    while pos < len(text):
        m = _TOKEN_RE.match(text, pos)
        if m is None:
            col = pos - line_start + 1
            raise FlowjitValueError(f"{filename}:{line}:{col}: expected a token of the text IR; found {text[pos]!r}")
        kind = m.lastgroup
        if kind != "ws":
            tokens.append(_Token(kind, m.group(), line, pos - line_start + 1))
        newlines = m.group().count("\n")
        if newlines:
            line += newlines
            line_start = m.start() + m.group().rindex("\n") + 1
        pos = m.end()
    tokens.append(_Token("eof", "", line, pos - line_start + 1))
    return tokens


_IR_DTYPES = {d.name: d for d in dt.ALL_DTYPES}


def ir_dtype(name: str) -> dt.DType:
    """The dtype printed as `name` (`f32`, `i64`, `bool`, ...); only the IR's own names are accepted."""
    found = _IR_DTYPES.get(name)
    if found is None:
        raise ValueError(f"unknown dtype '{name}'; the text IR's dtypes are {', '.join(_IR_DTYPES)}")
    return found


def parse_type(text: str) -> TensorType:
    """`tensor<4x8xf32>` -> TensorType((4, 8), f32); raises ValueError for an unknown dtype."""
    inner = text[len("tensor<") : -1]
    *dims, name = inner.split("x")
    return TensorType(tuple(int(d) for d in dims), ir_dtype(name))


class _Parser:
    def __init__(self, text: str, filename: str):
        self.filename = filename
        self.tokens = _tokenize(text, filename)
        self.pos = 0
        # Names of the graphs enclosing the region being parsed: not usable there, but still taken.
        self.enclosing: list[dict[str, Value]] = []

    # --- token helpers ---------------------------------------------------------------------------
    @property
    def tok(self) -> _Token:
        return self.tokens[self.pos]

    def fail_at(self, t: _Token, message: str) -> FlowjitValueError:
        return FlowjitValueError(f"{self.filename}:{t.line}:{t.col}: {message}")

    def error(self, expected: str) -> FlowjitValueError:
        t = self.tok
        found = repr(t.text) if t.kind != "eof" else "end of input"
        return self.fail_at(t, f"expected {expected}; found {found}")

    def accept(self, text: str) -> bool:
        if self.tok.text == text and self.tok.kind != "string":
            self.pos += 1
            return True
        return False

    def expect(self, text: str) -> None:
        if not self.accept(text):
            raise self.error(repr(text))

    def take(self, kind: str, what: str) -> str:
        if self.tok.kind != kind:
            raise self.error(what)
        self.pos += 1
        return self.tokens[self.pos - 1].text

    def string(self, what: str) -> str:
        at = self.tok
        text = self.take("string", what)
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise self.fail_at(at, f"expected {what} (a JSON string); found {text!r}: {e.msg}") from None

    def type(self) -> TensorType:
        t = self.tok
        text = self.take("type", "a tensor type like tensor<4x8xf32>")
        try:
            return parse_type(text)
        except ValueError as e:
            raise self.fail_at(t, f"bad type {text}: {e}") from None

    # --- grammar ---------------------------------------------------------------------------------
    def module(self) -> list[Graph]:
        graphs = []
        while self.tok.kind != "eof":
            at = self.tok
            graph = self.function()
            if any(g.name == graph.name for g in graphs):
                raise self.fail_at(at, f"function @{graph.name} is defined twice")
            graphs.append(graph)
        return graphs

    def function(self) -> Graph:
        self.expect("func")
        graph = Graph(self.take("symbol", "a function name like @f")[1:])
        env: dict[str, Value] = {}
        self.expect("(")
        self.params(graph, env)
        self.expect("->")
        self.expect("(")
        declared_at = self.tok
        declared = self.type_list(")")
        self.expect("{")
        self.body(graph, env, "return")
        self.expect("}")
        if graph.result_types != declared:
            raise self.fail_at(
                declared_at,
                f"function @{graph.name} declares results ({_types(declared)}) but returns "
                f"({_types(graph.result_types)})",
            )
        return graph

    def params(self, graph: Graph, env: dict) -> None:
        """`%x: T, %y: T)` up to and including the closing parenthesis."""
        while not self.accept(")"):
            if graph.params:
                self.expect(",")
            name = self.take("value", "a parameter name like %x")
            at = self.tokens[self.pos - 1]
            self.expect(":")
            self.define(env, name, graph.add_param(self.type(), name[1:]), at)

    def define(self, env: dict, name: str, value: Value, at: _Token) -> None:
        if name in env or any(name in outer for outer in self.enclosing):
            raise self.fail_at(at, f"value {name} is defined twice; SSA names must be unique")
        env[name] = value

    def type_list(self, close: str | None = None) -> list[TensorType]:
        types = []
        if close is not None and self.accept(close):
            return types
        types.append(self.type())
        while self.accept(","):
            types.append(self.type())
        if close is not None:
            self.expect(close)
        return types

    def ref(self, env: dict) -> Value:
        t = self.tok
        name = self.take("value", "a value like %0")
        if name in env:
            return env[name]
        if any(name in outer for outer in self.enclosing):
            raise self.fail_at(
                t,
                f"{name} is defined outside this region; a region sees only its parameters and its own ops "
                "(pass the value to the op as an operand)",
            )
        raise self.fail_at(t, f"use of undefined value {name} (values must be defined before their use)")

    def body(self, graph: Graph, env: dict, terminator: str) -> None:
        while not self.accept(terminator):
            if self.tok.kind == "eof" or self.tok.text == "}":
                raise self.error(f"an op or '{terminator}'")
            self.op(graph, env)
        results = []
        if self.tok.kind == "value":
            results.append(self.ref(env))
            while self.accept(","):
                results.append(self.ref(env))
            self.expect(":")
            types_at = self.tok
            types = self.type_list()
            if types != [r.type for r in results]:
                raise self.fail_at(
                    types_at,
                    f"'{terminator}' lists types ({_types(types)}) but its operands have types "
                    f"({_types(r.type for r in results)})",
                )
        graph.results = results

    def op(self, graph: Graph, env: dict) -> None:
        result_name, count, result_at = None, 0, self.tok
        if self.tok.kind == "value":
            result_name = self.take("value", "a result name")
            base, _, n = result_name.partition(":")
            result_name, count = base, int(n) if n else 1
            self.expect("=")
        at = self.tok
        name = self.take("ident", "an op name")
        operands = []
        if self.tok.kind == "value":
            operands.append(self.ref(env))
            while self.accept(","):
                operands.append(self.ref(env))
        attrs = self.attr_dict() if self.tok.text == "{" else {}
        regions = self.regions(env) if self.tok.text == "(" else []
        self.expect(":")
        types = self.op_result_types()
        device, loc = self.trailing()
        if len(types) != count:
            raise self.fail_at(at, f"op '{name}' defines {count} result(s) but lists {len(types)} type(s)")
        op = self.build(at, name, operands, attrs, loc, regions, device, types)
        graph.append(op)
        if count == 1:
            self.define(env, result_name, op.results[0], result_at)
        for i, r in enumerate(op.results if count > 1 else []):
            self.define(env, f"{result_name}#{i}", r, result_at)

    def build(self, at: _Token, name, operands, attrs, loc, regions, device, types) -> Op:
        """The op, checked against its definition; errors point at the op's name in the text."""
        try:
            op = make_op(name, operands, attrs, loc, regions=regions, device=device, result_types=types)
            check_op(op)
        except FlowjitError as e:
            raise self.fail_at(at, str(e)) from None
        return op

    def op_result_types(self) -> list[TensorType]:
        if self.accept("("):
            self.expect(")")
            return []
        return self.type_list()

    def trailing(self) -> tuple[str | None, Location]:
        """The optional `device("...")` and `loc("file":line)` after an op's types."""
        device, loc = None, UNKNOWN
        if self.accept("device"):
            self.expect("(")
            device = self.string("a device string")
            self.expect(")")
        if self.accept("loc"):
            self.expect("(")
            file = self.string("a file name")
            self.expect(":")
            line = self.take("number", "a line number")
            if not line.isdigit():
                raise self.error("a line number")
            loc = Location(file, int(line))
            self.expect(")")
        return device, loc

    def regions(self, env: dict) -> list[Graph]:
        self.expect("(")
        regions = []
        while True:
            self.expect("{")
            region = Graph(self.take("block", "a block label like ^body")[1:])
            inner: dict[str, Value] = {}
            self.enclosing.append(env)
            self.expect("(")
            self.params(region, inner)
            self.expect(":")
            self.body(region, inner, "yield")
            self.enclosing.pop()
            self.expect("}")
            regions.append(region)
            if not self.accept(","):
                break
        self.expect(")")
        return regions

    def attr_dict(self) -> dict:
        self.expect("{")
        attrs = {}
        while not self.accept("}"):
            if attrs:
                self.expect(",")
            at = self.tok
            # `inf` and `nan` lex as numbers but are fine attribute names.
            key = self.take("number", "") if at.text in ("inf", "nan") else self.take("ident", "an attribute name")
            if key in attrs:
                raise self.fail_at(at, f"attribute '{key}' is given twice")
            self.expect("=")
            attrs[key] = self.attr_value()
        return attrs

    def attr_value(self):
        t = self.tok
        if t.kind == "string":
            return self.string("a string")
        if t.kind == "number":
            self.pos += 1
            return _number(t.text)
        if self.accept("["):
            items = []
            while not self.accept("]"):
                if items:
                    self.expect(",")
                items.append(self.attr_value())
            return tuple(items)
        if t.text == "array":
            return self.array()
        if t.kind == "ident":
            self.pos += 1
            if t.text in ("true", "false"):
                return t.text == "true"
            try:
                return ir_dtype(t.text)
            except ValueError:
                raise self.fail_at(
                    t,
                    "expected an attribute value (number, string, true/false, dtype, [...], array<...>); "
                    f"found {t.text!r}",
                ) from None
        raise self.error("an attribute value")

    def array(self) -> np.ndarray:
        self.expect("array")
        self.expect("<")
        ttype = self.type()
        self.expect(",")
        at = self.tok
        if at.kind == "hex":
            values = self.hex_data(ttype)
        elif at.kind == "ident" and at.text == "iota":
            values = self.iota_data(ttype)
        else:
            values = self.literal_data(ttype)
        self.expect(">")
        return values.reshape(ttype.shape)

    def hex_data(self, ttype: TensorType) -> np.ndarray:
        at = self.tok
        digits = self.take("hex", "hex data")[2:]
        if len(digits) != 2 * ttype.nbytes:
            raise self.fail_at(at, f"expected {ttype.nbytes} bytes of data for {ttype}; found {len(digits) / 2:g}")
        np_dtype = ttype.dtype.np_dtype
        return np.frombuffer(bytes.fromhex(digits), dtype=np_dtype.newbyteorder("<")).astype(np_dtype)

    def iota_data(self, ttype: TensorType) -> np.ndarray:
        """`iota(start, step)`: element i (row-major) is start + i * step, in an integer tensor."""
        at = self.tok
        self.expect("iota")
        self.expect("(")
        start = self.integer("the first value")
        self.expect(",")
        step = self.integer("the step")
        self.expect(")")
        if not ttype.dtype.is_int:
            raise self.fail_at(at, f"iota(start, step) needs an integer tensor; found {ttype}")
        last = start + step * max(ttype.size - 1, 0)
        for value in (start, last):
            if not _fits(value, ttype.dtype):
                raise self.fail_at(at, f"iota({start}, {step}) reaches {value}, outside the range of {ttype.dtype}")
        if ttype.size < 2:
            return np.full(ttype.size, start, ttype.dtype.np_dtype)
        # every element lies between start and last, which fit: int64 arithmetic cannot overflow,
        # and only a pair (the two ends of the int64 range) has a step outside int64
        if -(2**63) <= step < 2**63:
            values = np.int64(start) + np.int64(step) * np.arange(ttype.size, dtype=np.int64)
            return values.astype(ttype.dtype.np_dtype)
        return np.array([start, last], ttype.dtype.np_dtype)

    def integer(self, what: str) -> int:
        text = self.take("number", what)
        try:
            return int(text)
        except ValueError:
            raise self.fail_at(self.tokens[self.pos - 1], f"expected an integer as {what}; found {text!r}") from None

    def literal_data(self, ttype: TensorType) -> np.ndarray:
        at = self.tok
        items = self.attr_value()
        if not isinstance(items, (tuple, str)) and ttype.size > 1:  # one value: every element's (a splat)
            items = (items,) * ttype.size
        if not isinstance(items, tuple) or len(items) != ttype.size:
            found = f"{len(items)} values" if isinstance(items, tuple) else repr(items)
            raise self.fail_at(at, f"expected a list of {ttype.size} values for {ttype}; found {found}")
        kind = ttype.dtype.kind
        for item in items:
            if not _fits(item, ttype.dtype):
                expected = {"b": "true or false", "i": f"an integer in the range of {ttype.dtype}", "f": "a number"}
                raise self.fail_at(at, f"expected {expected[kind]} in {ttype}; found {item!r}")
        if kind == "f":
            return np.array([float(v) for v in items], np.float64).astype(ttype.dtype.np_dtype)
        return np.array(items, dtype=ttype.dtype.np_dtype)


def _fits(item, dtype: dt.DType) -> bool:
    if dtype.is_bool:
        return isinstance(item, bool)
    if isinstance(item, bool):
        return False
    if dtype.is_int:
        info = np.iinfo(dtype.np_dtype)
        return isinstance(item, int) and info.min <= item <= info.max
    return isinstance(item, int | float)


def _types(types) -> str:
    return ", ".join(str(t) for t in types)


def _number(text: str):
    if text in ("nan", "inf", "-inf") or any(c in text for c in ".eE"):
        return float(text)
    return int(text)


def parse_module(text: str, filename: str = "<text>") -> list[Graph]:
    """Parse every function in `text`; errors name `filename:line:col`."""
    return _Parser(text, filename).module()


def parse_graph(text: str, filename: str = "<text>") -> Graph:
    """Parse text holding exactly one function."""
    graphs = parse_module(text, filename)
    if len(graphs) != 1:
        raise FlowjitValueError(f"{filename}: expected one function; found {len(graphs)}")
    return graphs[0]
