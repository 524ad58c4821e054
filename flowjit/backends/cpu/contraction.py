"""What the CPU lowerings of contractions and windowed reductions share (`lower_dot`, `lower_conv`,
`lower_pooling`, `lower_arg_extreme`).

Sums accumulate in `accumulator_elem`: half types (f16, bf16) in f32, rounded once at the end
(`narrow`), as the reference implementations do. Every contraction has a portable form,
`contraction_generic`: one `linalg.generic` whose indexing maps encode the op's dimension numbers
(dot_general's batch/contracting dims, conv2d's stride and dilation), correct for every shape and
dtype, split over the cores when large (`split_over_cores`). `Epilogue` is the pointwise ops of a
fusion that a conv2d or dot_general applies to its output window by window (`lower_fusion`
implements it). Choices and measurements: docs/cpu-kernels.md, section Contractions.
"""

from __future__ import annotations

import numpy as np

from flowjit.backends.cpu import host
from flowjit.backends.mlir.emitter import KernelEmitter, ScalarBuilder, elem_type, tensor_type
from flowjit.backends.mlir.lower_movement import fill
from flowjit.ir import dtypes as dt
from flowjit.ir.graph import Op
from flowjit.ir.types import TensorType

HALF_ELEMS = ("f16", "bf16")


def accumulator_elem(dtype: dt.DType) -> str:
    """MLIR element type that sums of `dtype` accumulate in (f32 for the half types)."""
    elem = elem_type(dtype)
    return "f32" if elem in HALF_ELEMS else elem


def widen(b: ScalarBuilder, value: str, elem: str, acc: str) -> str:
    """The scalar `value` of element `elem` extended to the accumulator type `acc`."""
    return value if elem == acc else b.op(f"arith.extf {value} : {elem} to {acc}")


def multiply_add(b: ScalarBuilder, x: str, y: str, acc_value: str, acc: str) -> str:
    """acc_value + x * y in the accumulator type (integers wrap, as numpy's do)."""
    if acc.startswith("i"):
        return b.op(f"arith.addi {acc_value}, {b.op(f'arith.muli {x}, {y} : {acc}')} : {acc}")
    return b.op(f"arith.addf {acc_value}, {b.op(f'arith.mulf {x}, {y} : {acc}')} : {acc}")


def const(em: KernelEmitter, value, dtype_or_elem) -> str:
    """A function-level scalar constant; `dtype_or_elem` is a flowjit DType or an MLIR type name."""
    b = ScalarBuilder(em, em.indent)
    name = b.const(value, dtype_or_elem if isinstance(dtype_or_elem, str) else elem_type(dtype_or_elem))
    em.body.extend(b.lines)
    return name


def narrow(em: KernelEmitter, x: str, t: TensorType, acc: str) -> str:
    """The accumulator tensor `x` (of `t`'s shape, element `acc`) rounded to `t`'s dtype."""
    return _cast_elements(em, x, t, acc, elem_type(t.dtype), "truncf")


def _cast_elements(em: KernelEmitter, x: str, t: TensorType, source: str, target: str, cast: str) -> str:
    """`x` (of `t`'s shape, element `source`) with each element cast (`arith.<cast>`) to `target`."""
    if source == target:
        return x
    ident = em.identity_map(t.rank)
    return em.generic(
        [(x, tensor_type(t, source))],
        (em.empty(t, target), tensor_type(t, target)),
        [ident, ident],
        ["parallel"] * t.rank,
        lambda b, args: b.op(f"arith.{cast} {args[0]} : {source} to {target}"),
        [source],
        target,
    )


def loop_dims(n: int, first: int = 0) -> list[str]:
    """The names of `n` loop dims of an affine map from d`first` on."""
    return [f"d{i}" for i in range(first, first + n)]


# Generic kernels with fewer scalar operations than this stay on one thread.
PARALLEL_MIN_WORK = 1 << 18


def split_over_cores(em: KernelEmitter, generic: str, first_dim: int, work: int) -> None:
    """Run the `linalg.generic` named `generic` as one `scf.forall` chunk of its first (parallel)
    loop per core, when its `work` (scalar operations) pays for an OpenMP fork."""
    threads = host.cores()
    if threads < 2 or work < PARALLEL_MIN_WORK or first_dim < 2:
        return
    chunk = -(-first_dim // threads)

    def steps(h: str) -> list[str]:
        any_op = "!transform.any_op"
        return [
            f"%par{h[1:]}, %forall{h[1:]} = transform.structured.tile_using_forall {h} tile_sizes [{chunk}] "
            f": ({any_op}) -> ({any_op}, {any_op})"
        ]

    em.schedule(generic, steps)


def contraction_generic(
    em: KernelEmitter,
    inputs: list[tuple[str, TensorType, str]],
    result: TensorType,
    iterators: list[str],
    reduction_size: int,
) -> str:
    """sum over the "reduction" loop dims of lhs * rhs. `inputs` gives each operand with the
    expressions of its indexing map over loop dims d0.. (in `iterators`' order, which is the loop
    nest's order); the result is indexed by the leading loop dims. `reduction_size` (the product
    of the reduction loops' bounds) sizes the work for threading."""
    acc = accumulator_elem(result.dtype)
    elem = elem_type(result.dtype)
    domain = ", ".join(loop_dims(len(iterators)))
    maps = [em.affine_map(f"({domain}) -> ({exprs})") for _, _, exprs in inputs]
    maps.append(em.affine_map(f"({domain}) -> ({', '.join(loop_dims(result.rank))})"))
    init = fill(em, const(em, 0, acc), result, acc)

    def body(b: ScalarBuilder, args):
        x, y = (widen(b, a, elem, acc) for a in args[:2])
        return multiply_add(b, x, y, args[2], acc)

    summed = em.generic(
        [(name, tensor_type(t)) for name, t, _ in inputs],
        (init, tensor_type(result, acc)),
        maps,
        iterators,
        body,
        [elem, elem],
        acc,
    )
    if result.rank and iterators[0] == "parallel":
        split_over_cores(em, summed, result.shape[0], result.size * reduction_size)
    return narrow(em, summed, result, acc)


def widen_tensor(em: KernelEmitter, x: str, t: TensorType, acc: str) -> str:
    """The tensor `x` (of `t`) extended to the accumulator type `acc`."""
    return _cast_elements(em, x, t, elem_type(t.dtype), acc, "extf")


def size_of(dims, shape) -> int:
    """The product of `shape`'s extents along `dims`."""
    return int(np.prod([shape[d] for d in dims], dtype=np.int64))


class Epilogue:
    """The pointwise ops a fusion applies to a contraction's result (bias, activation), computed
    window by window as the contraction makes its output (`lower_fusion` implements it): `elem`
    is the storage element of what it returns.

    `apply(em, product, onhw, window, origin, into, serial)` (conv2d) returns the epilogue of one
    window of the output, a tensor of `window`'s (N, O, OH, OW) shape, from the product of that
    window in the accumulator type, laid out (O, N, OH, OW) when `onhw` (the matmul form's
    columns) else (N, O, OH, OW); `origin` = (first image, first output row) of the window (index
    values; None: the whole output), `into` the tensor to compute it into (a slice of the output,
    so that nothing is copied; None: a new one), `serial` whether it runs on the calling thread
    (inside a parallel loop).

    `window(em, product, window, offsets, into, serial)` (dot_general) is the same for a product
    laid out as the window itself: `offsets` maps each dimension the window cuts to its first
    index (an index value); `into` may be `product` itself (computed in place).

    `reads_along(d)`: whether a tensor the epilogue reads besides the product varies along the
    output's dimension `d` (a residual does along every one; a bias along columns only);
    `columns_only()`: whether each such tensor is at most a vector along the last dimension (a
    bias) or a scalar: then `window(.., flat_rows=True)` takes windows of the output viewed as a
    matrix, its leading dimensions flattened; `as_matrix()`: whether each is that or a tensor of
    the output's whole shape (a residual): then `window(.., flat_rows=True)` takes all of it.

    `pool`: the attributes of a pooling that ends a conv's epilogue (`fuse._tiling_pool`: windows
    that tile the image), else None. Then `apply` returns the pooled window, `out_shape(shape)` of
    it, and fills `into` of that shape; a window's rows start at a multiple of the pool's height."""

    elem: str
    pool: dict | None = None
    accumulated = False  # whether `accumulate_into` gave the caller a tensor to write

    def accumulate_into(self):
        """A tensor the epilogue may write its whole result into, one it reads at the result's own
        index (a loop's accumulator), or None."""
        return None

    def out_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of what `apply` makes of a conv output window of `shape`."""
        if self.pool is None:
            return tuple(shape)
        _, _, height, width = self.pool["window"]
        return (*shape[:2], shape[2] // height, shape[3] // width)

    def reads_along(self, d: int) -> bool:
        raise NotImplementedError

    def columns_only(self) -> bool:
        raise NotImplementedError

    def as_matrix(self) -> bool:
        raise NotImplementedError

    def apply(self, em: KernelEmitter, product: str, onhw: bool, window: TensorType, origin, into, serial) -> str:
        raise NotImplementedError

    def window(self, em: KernelEmitter, product: str, window: TensorType, offsets: dict, into, serial, flat_rows=False):
        raise NotImplementedError


def streams_epilogue(op: Op) -> bool:
    """Whether `lower_conv2d` / `lower_dot_general` take an epilogue for `op`: its product is in the
    storage type (float32 or float64 accumulate in their own type; half types round the f32 sum
    first)."""
    return accumulator_elem(op.result.dtype) == elem_type(op.result.dtype)


def combine(b, kind: str, total: str, value: str, value_type: str, is_int: bool) -> str:
    """`total` and `value` (scalars or vectors of `value_type`) combined by a window reduction's `kind`:
    max, else a sum."""
    if kind == "max" and is_int:
        return b.op(f"arith.maxsi {total}, {value} : {value_type}")
    if kind == "max":
        # NaN-propagating, but -0.0 and +0.0 unordered (`nsz`, as numpy's max leaves them): x86 then
        # takes a max, a NaN test and a blend; ordering the zeros cost three more instructions per
        # max, and a 2x2 max pool takes three maxima per vector of outputs.
        return b.op(f"arith.maximumf {total}, {value} fastmath<nsz> : {value_type}")
    return b.op(f"arith.{'addi' if is_int else 'addf'} {total}, {value} : {value_type}")
