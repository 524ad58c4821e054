"""Parser for the text IR written by `printer.py` (the input of `flowjit opt` and the lit tests).

Errors name the line and column of the text and what was expected there.
"""

from __future__ import annotations

import json
import re

import numpy as np

from flowjit.errors import FlowjitValueError
from flowjit.ir import dtypes as dt
from flowjit.ir.builder import make_op
from flowjit.ir.graph import Graph, Value
from flowjit.ir.location import UNKNOWN, Location
from flowjit.ir.types import TensorType

_TOKEN_RE = re.compile(
    r"""
    (?P<ws>[ \t\r\n]+|//[^\n]*)
  | (?P<type>tensor<(?:\d+x)*[a-z][a-z0-9]*>)
  | (?P<value>%[A-Za-z0-9_.$]+(?:[:#]\d+)?)
  | (?P<symbol>@[A-Za-z0-9_.$]+)
  | (?P<block>\^[A-Za-z0-9_.$]+)
  | (?P<string>"(?:[^"\\]|\\.)*")
  | (?P<hex>0x[0-9a-fA-F]*)
  | (?P<number>-?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|inf)|nan)
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


def _tokenize(text: str) -> list[_Token]:
    tokens, pos, line, line_start = [], 0, 1, 0
    while pos < len(text):
        m = _TOKEN_RE.match(text, pos)
        if m is None:
            raise FlowjitValueError(f"line {line}:{pos - line_start + 1}: unexpected character {text[pos]!r}")
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


def parse_type(text: str) -> TensorType:
    inner = text[len("tensor<") : -1]
    *dims, name = inner.split("x")
    return TensorType(tuple(int(d) for d in dims), dt.dtype(name))


class _Parser:
    def __init__(self, text: str):
        self.tokens = _tokenize(text)
        self.pos = 0

    # --- token helpers ---------------------------------------------------------------------------
    @property
    def tok(self) -> _Token:
        return self.tokens[self.pos]

    def error(self, expected: str) -> FlowjitValueError:
        t = self.tok
        found = repr(t.text) if t.kind != "eof" else "end of input"
        return FlowjitValueError(f"line {t.line}:{t.col}: expected {expected}; found {found}")

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

    # --- grammar ---------------------------------------------------------------------------------
    def module(self) -> list[Graph]:
        graphs = []
        while self.tok.kind != "eof":
            graphs.append(self.function())
        return graphs

    def function(self) -> Graph:
        self.expect("func")
        graph = Graph(self.take("symbol", "a function name like @f")[1:])
        env: dict[str, Value] = {}
        self.expect("(")
        self.params(graph, env, ")")
        self.expect("->")
        self.expect("(")
        declared = self.type_list(")")
        self.expect("{")
        self.body(graph, env, "return")
        self.expect("}")
        if [r.type for r in graph.results] != declared:
            raise FlowjitValueError(f"function @{graph.name} returns {graph.result_types} but declares {declared}")
        return graph

    def params(self, graph: Graph, env: dict, close: str) -> None:
        while not self.accept(close):
            if graph.params:
                self.expect(",")
            name = self.take("value", "a parameter name like %x")
            self.expect(":")
            value = graph.add_param(parse_type(self.take("type", "a tensor type")), name[1:])
            self.define(env, name, value)
            if self.tok.text != close:
                continue

    def define(self, env: dict, name: str, value: Value) -> None:
        if name in env:
            raise self.error(f"a fresh name (not {name}, defined twice)")
        env[name] = value

    def type_list(self, close: str | None = None) -> list[TensorType]:
        types = []
        if close is not None and self.accept(close):
            return types
        types.append(parse_type(self.take("type", "a tensor type")))
        while self.accept(","):
            types.append(parse_type(self.take("type", "a tensor type")))
        if close is not None:
            self.expect(close)
        return types

    def ref(self, env: dict) -> Value:
        name = self.take("value", "a value like %0")
        if name not in env:
            raise FlowjitValueError(f"line {self.tokens[self.pos - 1].line}: use of undefined value {name}")
        return env[name]

    def body(self, graph: Graph, env: dict, terminator: str) -> None:
        while not self.accept(terminator):
            self.op(graph, env)
        results = []
        if self.tok.kind == "value":
            results.append(self.ref(env))
            while self.accept(","):
                results.append(self.ref(env))
            self.expect(":")
            types = self.type_list()
            if types != [r.type for r in results]:
                raise self.error(f"{terminator} types matching its operands")
        graph.results = results

    def op(self, graph: Graph, env: dict) -> None:
        result_name, count = None, 0
        if self.tok.kind == "value":
            result_name = self.take("value", "a result name")
            base, _, n = result_name.partition(":")
            result_name, count = base, int(n) if n else 1
            self.expect("=")
        line = self.tok.line
        name = self.take("ident", "an op name")
        operands = []
        if self.tok.kind == "value":
            operands.append(self.ref(env))
            while self.accept(","):
                operands.append(self.ref(env))
        attrs = self.attr_dict() if self.tok.text == "{" else {}
        regions = self.regions(env) if self.tok.text == "(" else []
        self.expect(":")
        types = [] if self.accept("()") else self.op_result_types()
        device, loc = None, UNKNOWN
        if self.accept("device"):
            self.expect("(")
            device = json.loads(self.take("string", "a device string"))
            self.expect(")")
        if self.accept("loc"):
            self.expect("(")
            file = json.loads(self.take("string", "a file name"))
            self.expect(":")
            loc = Location(file, int(self.take("number", "a line number")))
            self.expect(")")
        if len(types) != count:
            raise FlowjitValueError(f"line {line}: op '{name}' declares {count} results but lists {len(types)} types")
        op = make_op(name, operands, attrs, loc, regions=regions, device=device, result_types=types)
        graph.append(op)
        if count == 1:
            self.define(env, result_name, op.results[0])
        for i, r in enumerate(op.results if count > 1 else []):
            self.define(env, f"{result_name}#{i}", r)

    def op_result_types(self) -> list[TensorType]:
        if self.accept("("):
            self.expect(")")
            return []
        return self.type_list()

    def regions(self, env: dict) -> list[Graph]:
        self.expect("(")
        regions = []
        while True:
            self.expect("{")
            region = Graph(self.take("block", "a block label like ^body")[1:])
            self.expect("(")
            self.params(region, env, ")")
            self.expect(":")
            self.body(region, env, "yield")
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
            key = self.take("ident", "an attribute name")
            self.expect("=")
            attrs[key] = self.attr_value()
        return attrs

    def attr_value(self):
        t = self.tok
        if t.kind == "string":
            self.pos += 1
            return json.loads(t.text)
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
                return dt.dtype(t.text)
            except ValueError:
                raise FlowjitValueError(f"line {t.line}:{t.col}: unknown attribute value {t.text!r}") from None
        raise self.error("an attribute value")

    def array(self) -> np.ndarray:
        self.expect("array")
        self.expect("<")
        ttype = parse_type(self.take("type", "a tensor type"))
        self.expect(",")
        np_dtype = ttype.dtype.np_dtype
        if self.tok.kind == "hex":
            raw = bytes.fromhex(self.take("hex", "hex data")[2:])
            if len(raw) != ttype.nbytes:
                raise self.error(f"{ttype.nbytes} bytes of data for {ttype}")
            values = np.frombuffer(raw, dtype=np_dtype.newbyteorder("<")).astype(np_dtype)
        else:
            items = self.attr_value()
            if len(items) != ttype.size:
                raise self.error(f"{ttype.size} values for {ttype}")
            values = np.array([float(v) if ttype.dtype.is_float else v for v in items]).astype(np_dtype)
        self.expect(">")
        return values.reshape(ttype.shape)


def _number(text: str):
    if text in ("nan", "inf", "-inf") or any(c in text for c in ".eE"):
        return float(text)
    return int(text)


def parse_module(text: str) -> list[Graph]:
    """Parse every function in `text`."""
    return _Parser(text).module()


def parse_graph(text: str) -> Graph:
    """Parse text holding exactly one function."""
    graphs = parse_module(text)
    if len(graphs) != 1:
        raise FlowjitValueError(f"expected one function; found {len(graphs)}")
    return graphs[0]
