"""Building MLIR text, for any target.

`KernelEmitter` accumulates the body of one `func.func` operating on tensors, plus the top-level
attribute aliases it needs (which must sit outside `module {}`). `ScalarBuilder` writes the scalar
body of a `linalg.generic` region; a target's math library (the CPU's `mathlib.py`) and the
elementwise lowerings emit through it. Lowerings are plain functions registered in a target's
lowering table (`LOWERINGS`):

    LOWERINGS[op_name] = fn(em: KernelEmitter, op: Op, operands: list[str]) -> list[str]

taking the MLIR SSA names of the op's operand tensors and returning those of its result tensors.

Note for lowering authors (stable API: `LOWERINGS`, `em.generic`, `em.op`, `ScalarBuilder.op/const`,
`elem_type`, `tensor_type`). Added by the driver's owner:
- `em.schedule(generic, steps)` attaches a transform-dialect schedule (the CPU's: `schedule.py`) to
  a `linalg.generic`; untagged kernels are lowered to plain loops (LLVM may still vectorize them).
- bool operands arrive as i1 tensors made by `lowering.bool_from_bytes`; `bool_to_bytes` on such a
  tensor returns the original bytes instead of emitting a conversion (`em.bool_bytes`), so a lowering
  that moves bool data as bytes never creates an i1 buffer (MLIR 22 cannot store those).
- `em.flat_views` (`em.store_through`): results that are `expand_shape`s of a kernel's tensor of
  fewer dims (1-D, or a matrix) are stored through a view of their buffer collapsed to its shape.
- `ScalarBuilder.const(v, "i1")` emits `arith.constant true|false` (the typed form does not parse).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from flowjit.ir import dtypes as dt
from flowjit.ir.types import TensorType

if TYPE_CHECKING:
    from flowjit.backends.mlir.target import Target
    from flowjit.ir.graph import Op

# flowjit dtype -> MLIR element type. bool is i1 in registers and i8 in memory (numpy's layout);
# loads/stores of bool buffers go through `memory_elem_type`.
_ELEM = {
    dt.bool_: "i1",
    dt.int32: "i32",
    dt.int64: "i64",
    dt.float16: "f16",
    dt.bfloat16: "bf16",
    dt.float32: "f32",
    dt.float64: "f64",
}


def elem_type(dtype: dt.DType) -> str:
    """MLIR element type of `dtype` in registers (bool is i1)."""
    return _ELEM[dtype]


def memory_elem_type(dtype: dt.DType) -> str:
    """Element type of a buffer in memory (bool is stored as one byte, as numpy does)."""
    return "i8" if dtype is dt.bool_ else _ELEM[dtype]


def tensor_type(t: TensorType, elem: str | None = None) -> str:
    """`tensor<AxBxE>` for `t`, with element type `elem` if given."""
    dims = "".join(f"{d}x" for d in t.shape)
    return f"tensor<{dims}{elem or elem_type(t.dtype)}>"


def memref_type(t: TensorType) -> str:
    """`memref<AxBxE>` of `t`'s buffer (bool as i8)."""
    dims = "".join(f"{d}x" for d in t.shape)
    return f"memref<{dims}{memory_elem_type(t.dtype)}>"


def scalar_literal(value, dtype: dt.DType) -> str:
    """An `arith.constant` literal for `value` of `dtype` (floats in hex to be exact, nan/inf too)."""
    if dtype.is_bool:
        return "true" if value else "false"
    if dtype.is_int:
        return str(int(value))
    bits = np.asarray(value, dtype=dtype.np_dtype).view(f"u{dtype.itemsize}").item()
    return f"0x{bits:0{dtype.itemsize * 2}X}"


# Attribute a schedule puts on a loop whose loop-invariant subsets are hoisted after the cleanup.
HOIST_MARK = "fj.hoist"


class ScalarBuilder:
    """Writes SSA lines of a region body: `b.op("arith.addf %a, %b : f32")` returns the new name."""

    def __init__(self, emitter: KernelEmitter, indent: str):
        self.emitter = emitter
        self.indent = indent
        self.lines: list[str] = []

    def op(self, rhs: str) -> str:
        name = self.emitter.fresh()
        self.lines.append(f"{self.indent}{name} = {rhs}")
        return name

    def line(self, text: str) -> None:
        self.lines.append(f"{self.indent}{text}")

    def const(self, value, elem: str) -> str:
        """A scalar constant of MLIR element type `elem` ('f32', 'i64', 'i1', 'index')."""
        if elem == "index":
            return self.op(f"arith.constant {int(value)} : index")
        if elem == "i1":  # the bool literal carries its type; `true : i1` does not parse
            return self.op(f"arith.constant {'true' if value else 'false'}")
        if elem.startswith("i"):
            return self.op(f"arith.constant {int(value)} : {elem}")
        dtype = {"f16": dt.float16, "bf16": dt.bfloat16, "f32": dt.float32, "f64": dt.float64}[elem]
        return self.op(f"arith.constant {scalar_literal(value, dtype)} : {elem}")


class KernelEmitter:
    """Accumulates one MLIR function on tensors and the module-level aliases it uses."""

    def __init__(self, target: Target | None = None):
        # The target lowered for: its schedules and math library, and its `LoweringTable`, where
        # lowerings of ops nested in others (region bodies) look theirs up.
        self.target = target
        self.lowerings = target.lowerings if target is not None else None
        self._counter = 0
        self.aliases: dict[str, str] = {}  # text -> alias name
        self.body: list[str] = []
        self.indent = "    "
        self.schedules: list[str] = []  # transform-dialect lines for tagged kernels
        # i1 tensor -> the i8 tensor (numpy's bool bytes) holding the same data: conversions between
        # the two are looked up here instead of emitted again, so no i1 tensor needs a buffer.
        self.bool_bytes: dict[str, str] = {}
        # n-d tensor -> (the tensor of fewer dims it expands, that tensor's shape): see `store_through`.
        self.flat_views: dict[str, tuple[str, tuple[int, ...]]] = {}
        # Results of kernels that run a serial loop for each element (the GPU's `per_element` with
        # a loop): a target may keep elementwise fusion from repeating that loop in a consumer
        # that reads each element many times (`gpu.lower_kernels.broadcast_apart`).
        self.loop_kernels: set[str] = set()
        # (memref<Nxi8>, N): the function's scratch area for kernel temporaries (`LoweringTable.scratch`)
        self.scratch: tuple[str, int] | None = None
        # Module-level lines (globals, external function declarations) the function's kernels need.
        self.globals: list[str] = []
        # Tensors that are `arith.constant` literals (`literal`): strided inserts copy them first.
        self.literals: set[str] = set()
        # scatter_add ops that update a loop's carried buffer in place (`lower_control.in_place_updates`):
        # their lowering writes into their operand x instead of a copy of it.
        self.updated_in_place: set[Op] = set()
        # Ops of a loop body that may write their result into the buffer of one operand, by index:
        # a carried accumulator read by nothing else (`lower_control.accumulations`); and those
        # whose lowering did (`accumulated`), whose result the loop then yields as it is.
        self.accumulators: dict[Op, int] = {}
        self.accumulated: set[Op] = set()
        # The large constants of a control-flow op's regions, as tensors emitted before the op
        # (`lower_control._large_constants`): `lower_region` starts from these.
        self.region_values: dict = {}
        # Operand position -> `lowering.SliceView`, while an op whose operands include slices that no
        # kernel computed is lowered: its lowering reads their blocks from the slices' sources.
        self.operand_slices: dict = {}
        # Kinds of kernels made ("row_nest", "matmul", "sort"): a target's code generation may tune
        # itself to them (`MlirModule.kernel_kinds`; the CPU's `toolchain.codegen_settings`).
        self.kernel_kinds: set[str] = set()
        # Loops around the kernels being emitted (row-nest tile loops, `for`/`while` bodies): inside
        # one, a kernel runs many times per call (`schedule.reduction`'s `may_stay_plain`).
        self.loops = 0

    def store_through(self, result: str, kernel: str, shape: tuple[int, ...]) -> None:
        """`result`, an `expand_shape` of the kernel's tensor `kernel` of `shape` (1-D, or a matrix
        product (B * T, N) viewed as (B, T, N)), is stored through a view of the output buffer
        collapsed to `shape`, so that bufferization writes the kernel straight into it: through
        the `expand_shape`, empty-tensor elimination gives up and the kernel's tensor is a
        temporary copied out."""
        self.flat_views[result] = (kernel, shape)

    def fresh(self, prefix: str = "v") -> str:
        self._counter += 1
        return f"%{prefix}{self._counter}"

    def line(self, text: str) -> None:
        self.body.append(self.indent + text)

    def op(self, rhs: str) -> str:
        name = self.fresh()
        self.line(f"{name} = {rhs}")
        return name

    def literal(self, text: str, ttype: str) -> str:
        """An `arith.constant {text} : {ttype}` tensor, remembered as a literal."""
        name = self.op(f"arith.constant {text} : {ttype}")
        self.literals.add(name)
        return name

    def affine_map(self, text: str) -> str:
        """`#mapN` for `affine_map<text>`, declared once at module level."""
        if text not in self.aliases:
            self.aliases[text] = f"#map{len(self.aliases)}"
        return self.aliases[text]

    def identity_map(self, rank: int) -> str:
        dims = ", ".join(f"d{i}" for i in range(rank))
        return self.affine_map(f"({dims}) -> ({dims})")

    def declare(self, line: str) -> None:
        """Add a module-level line (an external function's declaration) once."""
        if line not in self.globals:
            self.globals.append(line)

    def pointer(self, memref: str, memref_ty: str) -> str:
        """The address of `memref`'s first element as an i64 (for calls into the runtime: send and
        recv; our buffers' memrefs have no offset)."""
        index = self.op(f"memref.extract_aligned_pointer_as_index {memref} : {memref_ty} -> index")
        return self.op(f"arith.index_cast {index} : index to i64")

    def empty(self, t: TensorType, elem: str | None = None) -> str:
        return self.op(f"tensor.empty() : {tensor_type(t, elem)}")

    def generic(
        self,
        inputs: Sequence[tuple[str, str]],
        init: tuple[str, str],
        indexing_maps: Sequence[str],
        iterator_types: Sequence[str],
        body: Callable[[ScalarBuilder, list[str]], str | Sequence[str]],
        input_elems: Sequence[str],
        output_elem: str,
    ) -> str:
        """A `linalg.generic` over `inputs` [(ssa, tensor type)] into `init` (ssa, tensor type).

        `body(b, args)` gets the scalar block arguments (inputs then the output's current value)
        and returns the value(s) to yield. Returns the result tensor's SSA name.
        """
        result = self.fresh()
        ins = ", ".join(n for n, _ in inputs)
        in_types = ", ".join(t for _, t in inputs)
        maps = ", ".join(indexing_maps)
        iters = ", ".join(f'"{i}"' for i in iterator_types)
        ins_clause = f"ins({ins} : {in_types}) " if inputs else ""
        self.line(
            f"{result} = linalg.generic {{indexing_maps = [{maps}], iterator_types = [{iters}]}} "
            f"{ins_clause}outs({init[0]} : {init[1]}) {{"
        )
        args = [self.fresh("a") for _ in range(len(inputs) + 1)]
        decl = ", ".join(f"{a}: {e}" for a, e in zip(args, [*input_elems, output_elem]))
        self.line(f"^bb0({decl}):")
        builder = ScalarBuilder(self, self.indent + "  ")
        yielded = body(builder, args)
        yielded = [yielded] if isinstance(yielded, str) else list(yielded)
        self.body.extend(builder.lines)
        self.line(f"  linalg.yield {', '.join(yielded)} : {', '.join([output_elem] * len(yielded))}")
        self.line(f"}} -> {init[1]}")
        return result

    def schedule(self, generic: str, steps: Callable[[str], Sequence[str]] | None) -> None:
        """Attach a transform-dialect schedule to the `linalg.generic` whose result is `generic`.

        The generic gets a unique `fj.kernel` attribute; `steps(handle)` returns the transform ops
        applied to the handle that matches it (the CPU's: `schedule.py`). `steps` None: the generic stays
        plain loops (`schedule.stays_plain`).
        """
        if steps is None:
            return
        marker = f"{generic} = linalg.generic {{"
        # From the end: the generic was usually just emitted (a scan from the start is quadratic: a
        # training step's body is about 10,000 lines for 22 schedules).
        for i in range(len(self.body) - 1, -1, -1):
            line = self.body[i]
            if line.lstrip().startswith(marker):
                tag = len(self.schedules)
                self.body[i] = line.replace(marker, f"{marker}fj.kernel = {tag} : i64, ", 1)
                break
        else:
            raise ValueError(f"no linalg.generic defines {generic}")
        handle = f"%k{tag}"
        lines = [
            f'{handle} = transform.structured.match ops{{["linalg.generic"]}} attributes{{fj.kernel = {tag} : i64}} '
            "in %root : (!transform.any_op) -> !transform.any_op",
            *steps(handle),
        ]
        self.schedules.append("\n".join(f"    {line}" for line in lines))

    def schedule_lines(self, schedules: Sequence[str] | None = None) -> list[str]:
        """The `@__transform_main` sequence applying every kernel's schedule, or those of `schedules`
        (a part of a split function), then the function-wide cleanups (empty if there are none)."""
        schedules = self.schedules if schedules is None else schedules
        if not schedules:
            return []
        return [
            "  transform.named_sequence @__transform_main(%root: !transform.any_op {transform.readonly}) {",
            *schedules,
            '    %func = transform.structured.match ops{["func.func"]} in %root '
            ": (!transform.any_op) -> !transform.any_op",
            "    transform.apply_patterns to %func {",
            "      transform.apply_patterns.vector.lower_masked_transfers",
            # Row tiles' vector<1x16xf32> would become LLVM arrays of one vector, taken apart and
            # put together around every op: 1-D vectors cut layer norm's MLIR time by a tenth.
            "      transform.apply_patterns.vector.cast_away_vector_leading_one_dim",
            '      transform.apply_patterns.vector.lower_multi_reduction lowering_strategy = "innerreduction"',
            "      transform.apply_patterns.canonicalization",
            "    } : !transform.any_op",
            # Loops the schedules marked (reductions' accumulators): their subsets are hoisted
            # once the function is canonical; canonicalization may fold some of them away.
            f"    %hoisted = transform.structured.match attributes{{{HOIST_MARK}}} in %root "
            ": (!transform.any_op) -> !transform.any_op",
            "    transform.loop.hoist_loop_invariant_subsets %hoisted : !transform.any_op",
            "    transform.yield",
            "  }",
        ]

    def module_prelude(self) -> str:
        return "".join(f"{alias} = affine_map<{text}>\n" for text, alias in self.aliases.items())
