"""Text form of the IR, MLIR-like, one op per line with result types and the user's source line:

    func @f(%x: tensor<4x8xf32>, %w: tensor<8x2xf32>) -> (tensor<4x2xf32>) {
      %0 = transpose %w {perm = [1, 0]} : tensor<2x8xf32> loc("model.py":6)
      %1 = reduce_sum %x {axes = [1]} : tensor<4xf32> loc("model.py":7)
      %2 = tanh %x : tensor<4x8xf32> device("cpu:0") loc("model.py":8)
      return %2 : tensor<4x8xf32>
    }

Constants print inline up to 16 elements (`array<tensor<2xf32>, [1.0, -0.0]>`) and as raw
little-endian hex above that (`array<tensor<32xf32>, 0x0000803f...>`); floats print as the
shortest decimal that reads back to the same value in their dtype, plus `nan`, `inf`, `-inf`.
A constant of two or more elements with the same bits (not a nan) prints as that one value
(`array<tensor<8x128x1xf32>, 1.0>`, as MLIR's `dense<1.0>`), not a list or 4 KiB of hex, and a
larger integer one whose elements step evenly as `iota(start, step)` (`fnp.flip`'s indices:
`array<tensor<1024xi64>, iota(1023, -1)>`), element i being start + i * step, row-major.

Multi-result ops print `%3:2 = ...` and are referenced as `%3#0`, `%3#1`. Regions print as
`({ ^bb(%a: T): ... yield %v : T }, {...})` after the attributes. The parser reads exactly this
form back; print -> parse -> print is the identity.
"""

from __future__ import annotations

import json
import math
import re

import numpy as np

from flowjit.ir.builder import single_value
from flowjit.ir.dtypes import DType
from flowjit.ir.graph import Graph, Op, Value
from flowjit.ir.types import TensorType

INLINE_ARRAY_LIMIT = 16
_NAME_RE = re.compile(r"[^A-Za-z0-9_.$]")
_SUBSCRIPT_RE = re.compile(r"""\[['"]?([^\]'"]*)['"]?\]""")  # pytree paths: params['w'][0] -> params.w.0


def format_float(x: float, dtype: DType | None = None) -> str:
    """A float as the text IR writes it: `nan`, `inf`, `-inf`, or the shortest decimal that reads back
    to the same value in `dtype` (f64 when None), so `0.1` in f32 prints `0.1`, not `0.10000000149011612`."""
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    x = float(x)
    if dtype is not None and dtype.bits < 64:
        target = np.asarray(x, dtype.np_dtype).tobytes()
        with np.errstate(over="ignore"):  # a too-short candidate may round to inf
            for digits in range(1, 18):
                shortest = float(f"{x:.{digits}g}")
                if np.asarray(shortest, dtype.np_dtype).tobytes() == target:
                    x = shortest
                    break
    text = repr(x)
    return text if any(c in text for c in ".en") else text + ".0"


def format_scalar(x, dtype: DType | None = None) -> str:
    if isinstance(x, (bool, np.bool_)):
        return "true" if x else "false"
    if isinstance(x, (int, np.integer)):
        return str(int(x))
    return format_float(float(x), dtype)


def format_array(a: np.ndarray) -> str:
    """`array<tensor<2x2xf32>, [1.0, 2.0, 3.0, 4.0]>`, raw little-endian hex when large, or the one
    value of a splat (`array<tensor<1024xf32>, 1.0>`)."""
    ttype = TensorType(a.shape, a.dtype)
    flat = a.reshape(-1)

    def scalar(v) -> str:
        return format_scalar(float(v), ttype.dtype) if ttype.dtype.is_float else format_scalar(v)

    if a.size > 1 and single_value(a) and not (ttype.dtype.is_float and np.isnan(flat[0])):
        return f"array<{ttype}, {scalar(flat[0])}>"  # a splat
    if a.size > INLINE_ARRAY_LIMIT:
        step = _progression(flat) if ttype.dtype.is_int else None
        if step is not None:  # flip's indices, an arange: `iota(start, step)`, not KiBs of hex
            return f"array<{ttype}, iota({int(flat[0])}, {step})>"
        data = np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<")).tobytes().hex()
        return f"array<{ttype}, 0x{data}>"
    return f"array<{ttype}, [{', '.join(scalar(v) for v in flat)}]>"


def _progression(flat: np.ndarray) -> int | None:
    """The step of integers `flat` if they are start, start + step, ... with step != 0, else None."""
    values = flat.astype(np.int64)
    start, step = int(values[0]), int(values[1]) - int(values[0])
    if step == 0 or start + step * (len(values) - 1) != int(values[-1]):
        return None
    # every term of the progression lies between the first and the last, both int64 values, and
    # with more than two terms so does the step: no int64 overflow below
    return step if np.array_equal(values, start + step * np.arange(len(values), dtype=np.int64)) else None


def format_attr(value) -> str:
    if isinstance(value, np.ndarray):
        return format_array(value)
    if isinstance(value, DType):
        return value.name
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, tuple):
        return "[" + ", ".join(format_attr(v) for v in value) + "]"
    return format_scalar(value)


class _Namer:
    """Assigns printed names: parameters keep a sanitized hint, op results are numbered."""

    def __init__(self):
        self.names: dict[Value, str] = {}
        self.taken: set[str] = set()
        self.counter = 0

    def param(self, value: Value, fallback: str) -> str:
        hint = _NAME_RE.sub("_", _SUBSCRIPT_RE.sub(r".\1", value.name_hint)) if value.name_hint else ""
        base = hint if hint and not hint[0].isdigit() else fallback
        name, k = base, 1
        while name in self.taken:
            name, k = f"{base}_{k}", k + 1
        self.taken.add(name)
        self.names[value] = "%" + name
        return self.names[value]

    def op(self, op: Op) -> str:
        n = str(self.counter)
        self.counter += 1
        if len(op.results) == 1:
            self.names[op.results[0]] = "%" + n
            return "%" + n
        for i, r in enumerate(op.results):
            self.names[r] = f"%{n}#{i}"
        return f"%{n}:{len(op.results)}"

    def ref(self, value: Value) -> str:
        try:
            return self.names[value]
        except KeyError:
            return f"%<undefined {value.type}>"


def _label(name: str, fallback: str) -> str:
    """A function or block name the parser reads back: other characters become `_`."""
    return _NAME_RE.sub("_", name) or fallback


def _types(types) -> str:
    return ", ".join(str(t) for t in types)


def _print_region(region: Graph, namer: _Namer, indent: str, lines: list[str]) -> None:
    args = ", ".join(f"{namer.param(p, f'a{namer.counter}_{i}')}: {p.type}" for i, p in enumerate(region.params))
    lines.append(f"{indent}^{_label(region.name, 'bb')}({args}):")
    _print_body(region, namer, indent + "  ", lines, "yield")


def _print_op(op: Op, namer: _Namer, indent: str, lines: list[str]) -> None:
    operands = ", ".join(namer.ref(v) for v in op.operands)
    head = f"{indent}{namer.op(op)} = {op.name}" if op.results else f"{indent}{op.name}"
    if operands:
        head += " " + operands
    if op.attrs:
        head += " {" + ", ".join(f"{k} = {format_attr(v)}" for k, v in sorted(op.attrs.items())) + "}"
    tail = " : " + (_types(r.type for r in op.results) if op.results else "()")
    if op.device:
        tail += f" device({json.dumps(op.device)})"
    if op.loc.file:
        tail += f" loc({json.dumps(op.loc.file)}:{op.loc.line})"
    if not op.regions:
        lines.append(head + tail)
        return
    lines.append(head + " ({")
    for i, region in enumerate(op.regions):
        if i:
            lines.append(f"{indent}}}, {{")
        _print_region(region, namer, indent, lines)
    lines.append(f"{indent}}})" + tail)


def _print_body(graph: Graph, namer: _Namer, indent: str, lines: list[str], terminator: str) -> None:
    for op in graph.ops:
        _print_op(op, namer, indent, lines)
    refs = ", ".join(namer.ref(v) for v in graph.results)
    lines.append(
        f"{indent}{terminator} {refs} : {_types(v.type for v in graph.results)}".rstrip()
        if graph.results
        else f"{indent}{terminator}"
    )


def print_graph(graph: Graph, header: str | None = None) -> str:
    """The text IR of one function, optionally preceded by `// header` comment lines."""
    namer = _Namer()
    params = ", ".join(f"{namer.param(p, f'arg{i}')}: {p.type}" for i, p in enumerate(graph.params))
    lines = [f"// {line}" for line in header.splitlines()] if header else []
    lines.append(f"func @{_label(graph.name, 'fn')}({params}) -> ({_types(graph.result_types)}) {{")
    _print_body(graph, namer, "  ", lines, "return")
    lines.append("}")
    return "\n".join(lines) + "\n"


def print_module(graphs: list[Graph], header: str | None = None) -> str:
    """Several functions in one text, separated by blank lines."""
    parts = [print_graph(g) for g in graphs]
    prefix = "".join(f"// {line}\n" for line in header.splitlines()) if header else ""
    return prefix + "\n".join(parts)
