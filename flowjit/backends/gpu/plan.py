"""The launch plan: a compiled GPU function's host side as plain data, which the runtime replays.

After the "gpu-kernels" stage the host function holds only kernel launches, constants, index
arithmetic, allocations (temporaries), views of buffers and serial `scf.for` loops around launches
(`compiler.lower_to_ptx` checks this). `extract_plan` walks it once, at compile time, with the MLIR
Python bindings and writes down what running it means:

    buffers   the function's inputs, outputs, workspace and temporaries (`memref.alloc`), each with
              its element type, shape and byte size
    steps     `Launch`: kernel, grid and block dimensions, and each kernel argument: a view of a
              buffer (`MemrefArg`: element offset, sizes, strides; the runtime expands it into the
              descriptor MLIR passes to a kernel: pointer, pointer, offset, sizes..., strides...) or a
              scalar (`ScalarArg`); `Loop`: a serial loop kept as one step, whose launches' offsets
              and scalars are affine in its induction variable (`Affine`)

A loop with few launches in all is unrolled (`UNROLL_MAX_LAUNCHES`). The plan is JSON data
(`to_json`, `from_json`): the runtime and the disk cache read it without MLIR. Every kernel's
parameters as the plan packs them are checked against the `.param` list of its PTX
(`check_against_ptx`), so a plan that would pass a kernel the wrong arguments is a compile error,
never a launch.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from flowjit.errors import CompileError

# Loops whose launches number at most this many in all are unrolled into the plan.
UNROLL_MAX_LAUNCHES = 16

# Every buffer a plan's kernels take starts at a multiple of this many bytes: the runtime's
# allocations (cuMemAlloc: 256) and the AOT library's arena slots (256) do, and a `DeviceArray` that
# does not (an imported view) comes through the host. Wide accesses (`wide_accesses.py`) rely on it.
BUFFER_ALIGNMENT = 16

# Bytes of one element of each MLIR element type a buffer may hold (i1 is stored as a byte).
ELEMENT_BYTES = {
    "i1": 1, "i8": 1, "i16": 2, "i32": 4, "i64": 8, "index": 8,
    "f16": 2, "bf16": 2, "f32": 4, "f64": 8,
}  # fmt: skip

# The PTX parameter type of each scalar kind a kernel takes (a pointer is "u64").
PARAM_KINDS = {
    "index": "u64", "i64": "u64", "i32": "u32", "i16": "u16", "i8": "u8", "i1": "u8",
    "f64": "f64", "f32": "f32", "f16": "b16", "bf16": "b16",
}  # fmt: skip
PARAM_BYTES = {"u64": 8, "f64": 8, "u32": 4, "f32": 4, "u16": 2, "b16": 2, "u8": 1}


@dataclass(frozen=True)
class Affine:
    """An index value: `constant` + sum of coefficient * loop variable over `terms` ((loop id,
    coefficient) pairs, sorted)."""

    constant: int
    terms: tuple[tuple[int, int], ...] = ()

    def at(self, loops: Mapping[int, int]) -> int:
        """Its value with each loop variable at `loops[id]`."""
        return self.constant + sum(c * loops[v] for v, c in self.terms)

    def plus(self, other: Affine) -> Affine:
        merged: dict[int, int] = dict(self.terms)
        for v, c in other.terms:
            merged[v] = merged.get(v, 0) + c
        return Affine(self.constant + other.constant, tuple(sorted((v, c) for v, c in merged.items() if c)))

    def times(self, k: int) -> Affine:
        return Affine(self.constant * k, tuple((v, c * k) for v, c in self.terms if c * k))


@dataclass(frozen=True)
class PlanBuffer:
    """A buffer the function uses: `kind` is 'input', 'output' (`index`: the position among the
    function's inputs or outputs), 'workspace' or 'temporary'."""

    kind: str
    index: int
    element: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ELEMENT_BYTES[self.element]


@dataclass(frozen=True)
class MemrefArg:
    """A view of buffer `buffer` (an index into `LaunchPlan.buffers`) passed to a kernel: offset in
    elements, sizes and strides in elements."""

    buffer: int
    offset: Affine
    sizes: tuple[int, ...]
    strides: tuple[int, ...]

    def param_kinds(self) -> list[str]:
        # allocated pointer, aligned pointer, offset, sizes, strides
        return ["u64"] * (3 + 2 * len(self.sizes))


@dataclass(frozen=True)
class ScalarArg:
    """A scalar passed to a kernel: an integer (`Affine`, possibly depending on loop variables) or
    a float, of MLIR type `kind` ('index', 'i32', 'f32', ...)."""

    kind: str
    value: Affine | float

    def param_kinds(self) -> list[str]:
        return [PARAM_KINDS[self.kind]]


@dataclass(frozen=True)
class Launch:
    """One `gpu.launch_func`: kernel `function` of module `module`, grid and block dimensions."""

    module: str
    function: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_bytes: int
    args: tuple[MemrefArg | ScalarArg, ...]

    def param_kinds(self) -> list[str]:
        """The kernel's parameters as the runtime packs them, in PTX types."""
        return [kind for arg in self.args for kind in arg.param_kinds()]


@dataclass(frozen=True)
class Loop:
    """A serial loop kept as one step: `body` runs for loop variable `var` = start, start + step,
    ... below stop."""

    var: int
    start: int
    stop: int
    step: int
    body: tuple[Launch | Loop, ...]

    @property
    def trips(self) -> int:
        return max(0, -(-(self.stop - self.start) // self.step))


@dataclass(frozen=True)
class LaunchPlan:
    """The host function of a compiled GPU function as data (see the module docstring)."""

    function: str
    buffers: tuple[PlanBuffer, ...]
    steps: tuple[Launch | Loop, ...]

    def launches(self) -> Iterator[tuple[Launch, dict[int, int]]]:
        """Every launch in the order the function makes them, with the loop variables' values."""
        yield from _launches(self.steps, {})

    def launch_count(self) -> int:
        return sum(1 for _ in self.launches())

    def kernels(self) -> list[str]:
        """The kernel modules the plan launches, each once, in order of first launch."""
        seen: dict[str, None] = {}
        for launch, _ in self.launches():
            seen.setdefault(launch.module, None)
        return list(seen)

    def to_json(self) -> dict:
        return {
            "function": self.function,
            "buffers": [[b.kind, b.index, b.element, list(b.shape)] for b in self.buffers],
            "steps": [_step_json(s) for s in self.steps],
        }

    @staticmethod
    def from_json(data: dict) -> LaunchPlan:
        buffers = tuple(
            PlanBuffer(kind, index, element, tuple(shape)) for kind, index, element, shape in data["buffers"]
        )
        return LaunchPlan(data["function"], buffers, tuple(_step_of(s) for s in data["steps"]))

    def text(self) -> str:
        """The plan as readable text (the stage 'launch-plan')."""
        lines = [f"launch plan of @{self.function}: {len(self.buffers)} buffers, {self.launch_count()} launches"]
        for i, b in enumerate(self.buffers):
            where = f"{b.kind} {b.index}" if b.kind in ("input", "output") else b.kind
            lines.append(f"  buffer {i}: {where} {b.element}{list(b.shape)} ({b.nbytes} bytes)")
        lines += _steps_text(self.steps, "  ")
        return "\n".join(lines)


def _launches(steps, loops: dict[int, int]) -> Iterator[tuple[Launch, dict[int, int]]]:
    for step in steps:
        if isinstance(step, Launch):
            yield step, loops
            continue
        for i in range(step.start, step.stop, step.step):
            yield from _launches(step.body, {**loops, step.var: i})


def _affine_text(a: Affine) -> str:
    parts = [f"{c}*i{v}" if c != 1 else f"i{v}" for v, c in a.terms]
    if a.constant or not parts:
        parts.append(str(a.constant))
    return " + ".join(parts)


def _steps_text(steps, indent: str) -> list[str]:
    lines = []
    for step in steps:
        if isinstance(step, Loop):
            lines.append(f"{indent}for i{step.var} in range({step.start}, {step.stop}, {step.step}):")
            lines += _steps_text(step.body, indent + "  ")
            continue
        args = []
        for arg in step.args:
            if isinstance(arg, MemrefArg):
                args.append(f"b{arg.buffer}[+{_affine_text(arg.offset)}; {list(arg.sizes)}; {list(arg.strides)}]")
            else:
                value = _affine_text(arg.value) if isinstance(arg.value, Affine) else repr(arg.value)
                args.append(f"{value}:{arg.kind}")
        lines.append(
            f"{indent}launch {step.module}::{step.function} grid {step.grid} block {step.block} ({', '.join(args)})"
        )
    return lines


def _affine_json(a: Affine) -> list:
    return [a.constant, [list(t) for t in a.terms]]


def _affine_of(data) -> Affine:
    return Affine(data[0], tuple((v, c) for v, c in data[1]))


def _step_json(step) -> dict:
    if isinstance(step, Loop):
        return {"loop": [step.var, step.start, step.stop, step.step], "body": [_step_json(s) for s in step.body]}
    args = []
    for arg in step.args:
        if isinstance(arg, MemrefArg):
            args.append({"buffer": arg.buffer, "offset": _affine_json(arg.offset), "sizes": list(arg.sizes),
                         "strides": list(arg.strides)})  # fmt: skip
        elif isinstance(arg.value, Affine):
            args.append({"scalar": arg.kind, "int": _affine_json(arg.value)})
        else:
            args.append({"scalar": arg.kind, "float": arg.value})
    return {"launch": [step.module, step.function], "grid": list(step.grid), "block": list(step.block),
            "shared_bytes": step.shared_bytes, "args": args}  # fmt: skip


def _step_of(data: dict):
    if "loop" in data:
        var, start, stop, step = data["loop"]
        return Loop(var, start, stop, step, tuple(_step_of(s) for s in data["body"]))
    args = []
    for arg in data["args"]:
        if "buffer" in arg:
            args.append(MemrefArg(arg["buffer"], _affine_of(arg["offset"]), tuple(arg["sizes"]), tuple(arg["strides"])))
        elif "int" in arg:
            args.append(ScalarArg(arg["scalar"], _affine_of(arg["int"])))
        else:
            args.append(ScalarArg(arg["scalar"], float(arg["float"])))
    module, function = data["launch"]
    return Launch(module, function, tuple(data["grid"]), tuple(data["block"]), data["shared_bytes"], tuple(args))


# --- PTX parameters -------------------------------------------------------------------------------

_ENTRY = re.compile(r"\.entry\s+(\w+)\s*\((.*?)\)", re.DOTALL)
_PARAM = re.compile(r"\.param\s+\.(\w+)")


def ptx_params(ptx: str, function: str) -> list[str]:
    """The types of the `.param`s of kernel `function` in `ptx` ('u64', 'f32', 'b32', ...)."""
    for name, params in _ENTRY.findall(ptx):
        if name == function:
            return _PARAM.findall(params)
    raise CompileError(f"internal error: no .entry {function} in the kernel's PTX")


def check_against_ptx(plan: LaunchPlan, ptx_of: Mapping[str, str]) -> None:
    """Every launch passes its kernel as many parameters as its PTX declares, each of the declared
    size (`ptx_of`: kernel module -> its PTX); a CompileError naming the kernel otherwise."""
    checked: set[tuple[str, str]] = set()
    for launch, _ in plan.launches():
        if (launch.module, launch.function) in checked:
            continue
        checked.add((launch.module, launch.function))
        declared = ptx_params(ptx_of[launch.module], launch.function)
        packed = launch.param_kinds()
        sizes = [PARAM_BYTES.get(k) for k in packed]
        declared_sizes = [int(re.sub(r"\D", "", t) or 8) // 8 for t in declared]
        if sizes != declared_sizes:
            raise CompileError(
                f"internal error: the launch plan passes kernel {launch.module}::{launch.function} parameters "
                f"{packed}, but its PTX declares {declared}"
            )


# --- extraction from the host function ------------------------------------------------------------


@dataclass(frozen=True)
class _View:
    """A memref value on the host: a view of a plan buffer."""

    buffer: int
    offset: Affine
    sizes: tuple[int, ...]
    strides: tuple[int, ...]


class _Poison:
    """`ub.poison`: a value nothing may depend on (passed as 0)."""


def extract_plan(module, function: str, inputs: int, outputs: int) -> LaunchPlan:
    """The launch plan of host function `function` in `module` (MLIR, after "gpu-kernels"), whose
    first `inputs` arguments are the inputs, the next `outputs` the outputs and any last one the
    workspace."""
    from mlir import ir

    func = next(
        (op for op in module.body.operations
         if op.operation.name == "func.func" and op.attributes["sym_name"].value == function),
        None,
    )  # fmt: skip
    if func is None:
        raise CompileError(f"internal error: no host function @{function} in the GPU module")
    block = func.regions[0].blocks[0]
    walker = _Walker(ir, module)
    env: dict = {}
    for i, arg in enumerate(block.arguments):
        kind, index = (
            ("input", i) if i < inputs else ("output", i - inputs) if i < inputs + outputs else ("workspace", 0)
        )
        env[arg] = walker.new_buffer(kind, index, arg.type)
    steps = walker.walk(block, env)
    buffers = walker.buffers
    used = set(_buffers_read(steps))
    # The workspace's slots became temporaries of their own (`memref.view`): unless a kernel still
    # takes the workspace itself, it needs no memory.
    buffers = [b if b.kind != "workspace" or i in used else PlanBuffer(b.kind, b.index, b.element, (0,))
               for i, b in enumerate(buffers)]  # fmt: skip
    return LaunchPlan(function, tuple(buffers), tuple(steps))


def _buffers_read(steps) -> Iterator[int]:
    """The buffer ids the kernels of `steps` take (loops' bodies included)."""
    for step in steps:
        if isinstance(step, Loop):
            yield from _buffers_read(step.body)
        else:
            yield from (arg.buffer for arg in step.args if isinstance(arg, MemrefArg))


class _Walker:
    """Evaluates the host function's ops symbolically: index values as `Affine`, memrefs as `_View`s."""

    def __init__(self, ir, module):
        self.ir = ir
        self.module = module
        self.buffers: list[PlanBuffer] = []
        self.allocs: dict = {}  # alloc op -> buffer id (one buffer per op, in loops too)
        self.loops = 0

    def new_buffer(self, kind: str, index: int, memref_type) -> _View:
        t = self.ir.MemRefType(memref_type)
        shape, strides, offset = self._layout(t, f"{kind} {index}")
        self.buffers.append(PlanBuffer(kind, index, str(t.element_type), shape))
        return _View(len(self.buffers) - 1, Affine(offset), shape, strides)

    def _layout(self, t, what: str) -> tuple[tuple[int, ...], tuple[int, ...], int | None]:
        """Shape, strides and offset (None: dynamic) of a static memref type."""
        dynamic = self.ir.ShapedType.get_dynamic_stride_or_offset()
        if not t.has_static_shape:
            raise CompileError(f"internal error: the GPU host function has a dynamic shape ({t}, {what})")
        if str(t.element_type) not in ELEMENT_BYTES:
            raise CompileError(f"internal error: no element size known for {t.element_type} ({t}, {what})")
        strides, offset = t.get_strides_and_offset()
        if any(s == dynamic for s in strides):
            raise CompileError(f"internal error: the GPU host function has dynamic strides ({t}, {what})")
        return tuple(t.shape), tuple(strides), None if offset == dynamic else offset

    def walk(self, block, env: dict) -> list:
        steps: list = []
        for op in block.operations:
            op = op.operation
            name = op.name
            if name == "gpu.launch_func":
                steps.append(self._launch(op, env))
            elif name == "scf.for":
                steps += self._loop(op, env)
            elif name == "func.call":
                steps += self._call(op, env)
            elif name in ("func.return", "scf.yield", "memref.dealloc"):
                if name == "scf.yield" and len(op.operands):
                    raise _unsupported(op, "a loop carrying values")
            else:
                env[op.results[0]] = self._value(op, env)
        return steps

    def _call(self, op, env) -> list:
        """The steps of a call of one of the module's functions (a kernel shared by identical ops:
        `lowering.shared_kernels`), its arguments bound to the caller's values."""
        if len(op.results):
            raise _unsupported(op, "a call with results")
        callee = self.ir.FlatSymbolRefAttr(op.attributes["callee"]).value
        func = next(
            (f for f in self.module.body.operations
             if f.operation.name == "func.func" and f.attributes["sym_name"].value == callee),
            None,
        )  # fmt: skip
        if func is None or not len(func.regions[0].blocks):
            raise _unsupported(op, f"a call of @{callee}, which the module does not define")
        block = func.regions[0].blocks[0]
        inner = {arg: env[value] for arg, value in zip(block.arguments, op.operands)}
        return self.walk(block, inner)

    def _index(self, op, env, i: int) -> Affine:
        value = env[op.operands[i]]
        if not isinstance(value, Affine):
            raise _unsupported(op, f"operand {i} is not an integer known on the host")
        return value

    def _constant(self, op, env, i: int) -> int:
        value = self._index(op, env, i)
        if value.terms:
            raise _unsupported(op, f"operand {i} depends on a loop variable")
        return value.constant

    def _value(self, op, env):
        """The value of a single-result host op."""
        name, ir = op.name, self.ir
        if name == "arith.constant":
            attr = op.attributes["value"]
            if isinstance(attr, ir.IntegerAttr):
                return Affine(ir.IntegerAttr(attr).value)
            if isinstance(attr, ir.FloatAttr):
                return ir.FloatAttr(attr).value
            raise _unsupported(op, "a constant that is not one integer or float")
        if name == "ub.poison":
            return _Poison()
        if name in ("arith.index_cast", "arith.index_castui", "arith.extsi", "arith.extui", "arith.trunci"):
            return self._index(op, env, 0)
        if name == "arith.addi":
            return self._index(op, env, 0).plus(self._index(op, env, 1))
        if name == "arith.subi":
            return self._index(op, env, 0).plus(self._index(op, env, 1).times(-1))
        if name == "arith.muli":
            a, b = self._index(op, env, 0), self._index(op, env, 1)
            if a.terms and b.terms:
                raise _unsupported(op, "a product of two loop variables")
            return a.times(b.constant) if not b.terms else b.times(a.constant)
        if name in _INTEGER_FOLDS:
            return Affine(_INTEGER_FOLDS[name](self._constant(op, env, 0), self._constant(op, env, 1)))
        if name == "memref.alloc":
            if len(op.operands):
                raise _unsupported(op, "an allocation of dynamic size")
            if op not in self.allocs:
                self.allocs[op] = self.new_buffer("temporary", 0, op.results[0].type)
            return self.allocs[op]
        if name == "memref.view":
            # A value's slot in the workspace (`plan_workspace`): a temporary of its own here. Slots
            # that share workspace bytes hold values that are never live at once, so separate
            # buffers compute the same; the caching allocator recycles their memory across calls.
            source = env[op.operands[0]]
            if not isinstance(source, _View) or self.buffers[source.buffer].kind != "workspace":
                raise _unsupported(op, "a view of something other than the workspace")
            if len(op.operands) > 2:
                raise _unsupported(op, "a view of dynamic size")
            if op not in self.allocs:
                self.allocs[op] = self.new_buffer("temporary", 0, op.results[0].type)
            return self.allocs[op]
        if name in ("memref.expand_shape", "memref.collapse_shape", "memref.cast"):
            return self._view(op, env[op.operands[0]].offset, env)
        if name == "memref.subview":
            return self._subview(op, env)
        if name == "memref.reinterpret_cast":
            return self._reinterpret(op, env)
        raise _unsupported(op, "an op the launch plan does not know")

    def _view(self, op, offset: Affine, env) -> _View:
        """The view `op` makes of its source (operand 0), starting `offset` elements in."""
        source = env[op.operands[0]]
        if not isinstance(source, _View):
            raise _unsupported(op, "a view of something that is not a buffer")
        shape, strides, static_offset = self._layout(self.ir.MemRefType(op.results[0].type), op.name)
        if static_offset is not None and not offset.terms and offset.constant != static_offset:
            raise CompileError(
                f"internal error: {op.name} at {op.location}: the launch plan computed offset {offset.constant}, "
                f"its type says {static_offset}"
            )
        return _View(source.buffer, offset, shape, strides)

    def _mixed(self, op, env, attr: str, dynamic_from: int) -> tuple[list[Affine], int]:
        """A static_offsets/sizes/strides list with its dynamic entries from the operands starting at
        `dynamic_from`, and the index of the next dynamic operand."""
        dynamic = self.ir.ShapedType.get_dynamic_stride_or_offset()
        values = []
        for v in self.ir.DenseI64ArrayAttr(op.attributes[attr]):
            if v == dynamic:  # the same sentinel as a dynamic size
                values.append(self._index(op, env, dynamic_from))
                dynamic_from += 1
            else:
                values.append(Affine(v))
        return values, dynamic_from

    def _subview(self, op, env) -> _View:
        source = env[op.operands[0]]
        offsets, _ = self._mixed(op, env, "static_offsets", 1)
        offset = source.offset
        for o, stride in zip(offsets, source.strides):
            offset = offset.plus(o.times(stride))
        return self._view(op, offset, env)

    def _reinterpret(self, op, env) -> _View:
        (offset,), _ = self._mixed(op, env, "static_offsets", 1)
        return self._view(op, offset, env)

    def _launch(self, op, env) -> Launch:
        ir = self.ir
        segments = list(ir.DenseI32ArrayAttr(op.attributes["operandSegmentSizes"]))
        # async deps, grid x y z, block x y z, cluster x y z, dynamic shared memory, kernel operands, async object
        if segments[0] or (len(segments) > 12 and segments[12]) or any(segments[7:10]):
            raise _unsupported(op, "an asynchronous or clustered launch")
        starts = [sum(segments[:i]) for i in range(len(segments))]
        dims = [self._constant(op, env, starts[i]) for i in range(1, 7)]
        shared = self._constant(op, env, starts[10]) if segments[10] else 0
        args = []
        for i in range(starts[11], starts[11] + segments[11]):
            value, t = env[op.operands[i]], op.operands[i].type
            if isinstance(value, _View):
                args.append(MemrefArg(value.buffer, value.offset, value.sizes, value.strides))
            elif str(t) not in PARAM_KINDS:
                raise _unsupported(op, f"a kernel argument of type {t}")
            elif isinstance(value, _Poison):
                args.append(ScalarArg(str(t), Affine(0) if str(t)[0] in "iu" else 0.0))
            else:
                args.append(ScalarArg(str(t), value))
        symbol = re.fullmatch(r'@"?([\w.$-]+)"?::@"?([\w.$-]+)"?', str(op.attributes["kernel"]))
        if symbol is None:
            raise _unsupported(op, f"a kernel named {op.attributes['kernel']}")
        return Launch(symbol[1], symbol[2], tuple(dims[:3]), tuple(dims[3:]), shared, tuple(args))

    def _loop(self, op, env) -> list:
        """An `scf.for`: its body's steps once per iteration (unrolled) when it launches little,
        else one `Loop` step."""
        if len(op.results):
            raise _unsupported(op, "a loop carrying values")
        start, stop, step = (self._constant(op, env, i) for i in range(3))
        if step <= 0:
            raise _unsupported(op, f"a loop of step {step}")
        body = op.regions[0].blocks[0]
        var = body.arguments[0]
        self.loops += 1
        loop_id = self.loops
        inner = self.walk(body, {**env, var: Affine(0, ((loop_id, 1),))})
        kept = Loop(loop_id, start, stop, step, tuple(inner))
        per_trip = sum(1 for _ in _launches(inner, _Zeros()))
        if kept.trips * per_trip > UNROLL_MAX_LAUNCHES:
            return [kept]
        unrolled = []
        for i in range(start, stop, step):
            unrolled += self.walk(body, {**env, var: Affine(i)})
        return unrolled


class _Zeros(dict):
    """Loop variables all at 0 (counting launches without values)."""

    def __missing__(self, key):
        return 0


_INTEGER_FOLDS = {
    "arith.divsi": lambda a, b: int(a / b),
    "arith.divui": lambda a, b: a // b,
    "arith.floordivsi": lambda a, b: a // b,
    "arith.ceildivsi": lambda a, b: -(-a // b),
    "arith.remsi": lambda a, b: int(math.fmod(a, b)),
    "arith.remui": lambda a, b: a % b,
    "arith.maxsi": max,
    "arith.minsi": min,
    "arith.maxui": max,
    "arith.minui": min,
}


def _unsupported(op, why: str) -> CompileError:
    return CompileError(f"internal error: the GPU launch plan cannot run {op.name} at {op.location} on the host: {why}")
