"""A fusion's pointwise ops on its contraction's result (bias, activation, a pool), computed window by
window as the conv2d or dot_general makes its output: the `contraction.Epilogue` that
`lower_fusion` hands to `lower_conv.lower_conv2d` and `lower_dot.lower_dot_general`.
"""

from __future__ import annotations

from flowjit.backends.cpu import contraction, lower_pooling, schedule
from flowjit.backends.cpu.fusion_ops import generic_body
from flowjit.backends.cpu.fusion_schedule import elem_bits
from flowjit.backends.mlir.emitter import ScalarBuilder, elem_type, memory_elem_type, tensor_type
from flowjit.backends.mlir.lowering import splat_value
from flowjit.ir.graph import Op, Value
from flowjit.ir.types import TensorType


class FusedEpilogue(contraction.Epilogue):
    """A fusion's pointwise ops on its contraction's result (`_FusionLowering.
    _contraction_with_epilogue`), as `contraction.Epilogue`: one n-d generic per window of the
    output, reading the window's product (in cache: a chunk of the im2col form's columns, a
    matmul's register tile just stored) and the window of each other leaf (bias and other
    broadcasts through their maps, full tensors sliced), writing the window of the result in
    place in the output. Its leaves are made before the contraction's loops."""

    def __init__(self, product: Value, target: Value, collected, inputs: list, pool: Op | None = None):
        """The epilogue computing `target` from `product` by `collected` = (the pointwise ops, the
        leaves they read besides the product, their splats); `inputs` gives each leaf's (tensor, type,
        indexing map) and the (loop dimension, extent) it reads (`_FusionLowering._input`,
        `_read_dims`), made before the contraction's loops."""
        self.product, self.target = product, target
        self.ops, self.leaves, self.splats = collected
        self.inputs = inputs
        self.elem = memory_elem_type(target.dtype)
        self.pool = pool.attrs if pool is not None else None
        # The index of a leaf of the result's type that the result may be written into (a loop's
        # accumulator: `lower_fusion`), and whether `accumulate_into` was used.
        self.accumulator: int | None = None
        self.accumulated = False

    def accumulate_into(self) -> str | None:
        """The tensor of the leaf the whole result may be written into, read through the output
        operand (`_generic`), or None; the caller then passes it as `into` for the whole window."""
        if self.accumulator is None:
            return None
        self.accumulated = True
        return self.inputs[self.accumulator][0][0]

    def apply(self, em, product, onhw, window, origin, into, serial) -> str:
        loop = ", ".join(f"d{i}" for i in range(window.rank))
        product_t = window.with_shape((window.shape[1], window.shape[0], *window.shape[2:])) if onhw else window
        product_map = em.affine_map(f"({loop}) -> ({'d1, d0' if onhw else 'd0, d1'}, {loop.split(', ', 2)[2]})")
        offsets = {0: origin[0], 2: origin[1]} if origin is not None else {}
        if self.pool is None:
            return self._generic(em, (product, product_t, product_map), window, offsets, into, serial)
        pooled = window.with_shape(self.out_shape(window.shape))
        if self.ops and self._commutes_with_max():  # pool first, then the ops on a quarter of the values
            out = lower_pooling.pool_window(em, (product, product_t), onhw, pooled, self.pool, into, serial)
            images = {0: offsets[0]} if 0 in offsets else {}  # its leaves read no rows
            return self._in_place(em, (out, pooled, em.identity_map(4)), pooled, images, serial)
        if self.ops:  # the pointwise ops in place on the product (in cache), then the pool reads it
            product = self._in_place(em, (product, product_t, product_map), window, offsets, serial)
        return lower_pooling.pool_window(em, (product, product_t), onhw, pooled, self.pool, into, serial)

    def _commutes_with_max(self) -> bool:
        """Whether a max pool may run before the pointwise ops: they are a non-decreasing function of
        the product, exactly, rounding included, whose other operands do not vary within a window
        (a bias, scalars), so the max of their results is their result on the max: additions,
        subtractions of constants, products and quotients by positive scalars, max and min, and
        relu's `select(x <= k, c, x)` with c <= k. (Math functions are left out: their polynomials
        need not be monotone to the last bit.) The CNN's bias + relu then run on a quarter of the
        conv's outputs."""
        if self.pool["kind"] != "max" or any(d >= 2 for _, dims in self.inputs for d, _ in dims):
            return False
        rising, predicates = {self.product}, set()

        def scalar(v: Value) -> float | None:
            value = splat_value(v)
            return None if value is None else float(value)

        for op in self.ops:
            args, name = op.operands, op.name
            up = [v in rising for v in args]
            if name == "select" and self._relu(op, rising, scalar):
                rising.add(op.result)
            elif any(v in predicates for v in args):
                return False  # a predicate on the product read other than by a relu's select
            elif not any(up):
                continue  # a value of the leaves alone: constant within a window
            elif name in ("add", "max", "min") or (name == "sub" and not up[1]):
                rising.add(op.result)
            elif name in ("mul", "div") and not up[1] and (scalar(args[1]) or 0) > 0:
                rising.add(op.result)
            elif name == "mul" and not up[0] and (scalar(args[0]) or 0) > 0:
                rising.add(op.result)
            elif name in ("le", "lt") and up == [True, False] and scalar(args[1]) is not None:
                predicates.add(op.result)  # a relu's, if only its select reads it
            else:
                return False
        return self.target in rising

    @staticmethod
    def _relu(op: Op, rising: set, scalar) -> bool:
        """`select(x <= k, c, x)` (or `<`) with x rising and c <= k: non-decreasing in x, NaN kept."""
        predicate, low, x = op.operands
        compare = predicate.producer
        if compare is None or compare.name not in ("le", "lt") or x not in rising or compare.operands[0] is not x:
            return False
        k, c = scalar(compare.operands[1]), scalar(low)
        return k is not None and c is not None and c <= k

    def _in_place(self, em, product, window: TensorType, offsets: dict, serial: bool) -> str:
        """The epilogue computed in place in the conv's product (before its pool), over its planes
        (H x W collapsed, one contiguous row each) when every leaf reads both H and W, as its last
        two dimensions, or neither (a bias): over rows of W, each row's last vector, masked when W is
        not a multiple of the vector, would make the next row's first read wait for that store (a
        partial overlap, which store forwarding does not serve), a measurable slowdown on the CNN's
        28-wide rows."""
        tensor, product_t, product_map = product
        if not all(all(d < 2 for d, _ in dims) or [d for d, _ in dims[-2:]] == [2, 3] for _, dims in self.inputs):
            return self._generic(em, product, window, offsets, tensor, serial)
        n, o, h, w = window.shape
        lead = product_t.shape[:2]
        flat_t = product_t.with_shape((*lead, h * w))
        acc = elem_type(self.product.dtype)
        collapse = f"[[0], [1], [2, 3]] : {tensor_type(product_t, acc)} into {tensor_type(flat_t, acc)}"
        flat = em.op(f"tensor.collapse_shape {tensor} {collapse}")
        flat_map = em.affine_map("(d0, d1, d2) -> (d1, d0, d2)" if lead != (n, o) else "(d0, d1, d2) -> (d0, d1, d2)")
        planes = window.with_shape((n, o, h * w))
        if 2 in offsets:
            offsets = {**offsets, 2: em.op(f"arith.muli {offsets[2]}, {em.op(f'arith.constant {w} : index')} : index")}
        done = self._generic(em, (flat, flat_t, flat_map), planes, offsets, flat, serial, planes=(h, w))
        expand = f"[[0], [1], [2, 3]] output_shape [{lead[0]}, {lead[1]}, {h}, {w}]"
        types = f"{tensor_type(flat_t, acc)} into {tensor_type(product_t, acc)}"
        return em.op(f"tensor.expand_shape {done} {expand} : {types}")

    def reads_along(self, d: int) -> bool:
        return any(dim == d and extent != 1 for _, dims in self.inputs for dim, extent in dims)

    def columns_only(self) -> bool:
        return all(self._columns(dims) for _, dims in self.inputs)

    def as_matrix(self) -> bool:
        full = list(range(self.product.type.rank))
        return all(self._columns(dims) or [d for d, _ in dims] == full for _, dims in self.inputs)

    def _columns(self, dims) -> bool:
        """Whether a leaf read through `dims` is at most a vector along the last dimension."""
        return len(dims) <= 1 and all(d == self.product.type.rank - 1 for d, _ in dims)

    def window(self, em, product, window, offsets, into, serial, flat_rows=False) -> str:
        whole = (product, window, em.identity_map(window.rank))
        return self._generic(em, whole, window, offsets, into, serial, flat_rows)

    def _generic(
        self, em, product, window: TensorType, offsets: dict, into, serial: bool, flat_rows=False, planes=None
    ) -> str:
        """The generic computing `window` of the result from `product` = (tensor, its shape as a
        TensorType, its indexing map) and the leaves' windows (`offsets`: `Epilogue.window`). When
        `into` is the product itself, the generic reads it as its output operand only (an input
        too would make the tiled loops read the tile's old value while they write it: a copy).
        `flat_rows`: `window` is (rows, columns) of the result viewed as a matrix (its leading
        dimensions flattened), which leaves reading columns at most allow (`columns_only`), and
        tensors of the result's whole shape when the window is all of it (`as_matrix`). `planes` =
        (H, W): `window` is (N, O, H x W), each leaf reading H and W read with them collapsed too
        (`_in_place`)."""
        rank = window.rank
        acc = elem_type(self.product.dtype)
        tensor, product_t, product_map = product
        in_place = into is tensor  # then written through the product's own map
        inputs = [] if in_place else [(tensor, tensor_type(product_t, acc), product_map)]
        # A leaf written over (`accumulate_into`) is read as the output operand only, like the product.
        overwritten = next((v for v, ((leaf, _, _), _) in zip(self.leaves, self.inputs) if leaf is into), None)
        for v, ((leaf, ttype, in_map), dims) in zip(self.leaves, self.inputs):
            if v is overwritten:
                continue
            if flat_rows and len(dims) > 1:  # a tensor of the result's shape, viewed as a matrix too
                leaf, ttype = self._as_matrix(em, leaf, v, window)
                dims, in_map = [(0, window.shape[0]), (1, window.shape[1])], em.identity_map(2)
            elif flat_rows:  # a bias along the columns, or a scalar
                dims = [(1, extent) for _, extent in dims]
                in_map = em.affine_map(f"(d0, d1) -> ({'d1' if dims else ''})")
            elif planes is not None:
                if dims and dims[-1][0] == 3:  # its last two dimensions are H and W: collapsed
                    leaf, ttype = self._planes(em, leaf, v, [e for _, e in dims])
                    dims = [*dims[:-2], (2, planes[0] * planes[1])]
                in_map = em.affine_map(f"(d0, d1, d2) -> ({', '.join(f'd{d}' for d, _ in dims)})")
            inputs.append((*self._window(em, leaf, ttype, v, dims, window, offsets), in_map))
        out_t = window.with_dtype(self.target.dtype)
        out_type = tensor_type(product_t, acc) if in_place else tensor_type(out_t, self.elem)
        into = into if into is not None else em.empty(out_t, self.elem)
        read = [v for v in self.leaves if v is not overwritten]
        in_elems = ([] if in_place else [acc]) + [memory_elem_type(v.dtype) for v in read]

        def body(b: ScalarBuilder, args: list[str]) -> list[str]:
            product_arg = [args[-1]] if in_place else []
            leaf_args = dict(zip([self.product, *read], product_arg + args[: len(in_elems)]))
            if overwritten is not None:
                leaf_args[overwritten] = args[-1]
            return generic_body(b, self.ops, leaf_args, self.splats, [self.target], None, args[-1])

        maps = [m for _, _, m in inputs] + [product_map if in_place else em.identity_map(rank)]
        inputs = [(t, tt) for t, tt, _ in inputs]
        name = em.generic(inputs, (into, out_type), maps, ["parallel"] * rank, body, in_elems, self.elem)
        widest = max(elem_bits(e) for e in in_elems + [acc, self.elem])
        em.schedule(name, schedule.copy_nd(window.shape, widest, parallel=not serial))
        return name

    @staticmethod
    def _planes(em, leaf: str, v: Value, shape: list[int]) -> tuple[str, str]:
        """Leaf `v` (as `leaf`, of `shape`) with its last two dimensions collapsed."""
        elem, rank = memory_elem_type(v.dtype), len(shape)
        flat = TensorType((*shape[:-2], shape[-2] * shape[-1]), v.dtype)
        groups = ", ".join([f"[{d}]" for d in range(rank - 2)] + [f"[{rank - 2}, {rank - 1}]"])
        flat_type = tensor_type(flat, elem)
        source = tensor_type(TensorType(tuple(shape), v.dtype), elem)
        return em.op(f"tensor.collapse_shape {leaf} [{groups}] : {source} into {flat_type}"), flat_type

    @staticmethod
    def _as_matrix(em, leaf: str, v: Value, matrix: TensorType) -> tuple[str, str]:
        """Leaf `v` (as `leaf`), of the result's shape, collapsed to the (rows, columns) `matrix`."""
        rank, elem = v.type.rank, memory_elem_type(v.dtype)
        rows = ", ".join(str(d) for d in range(rank - 1))
        matrix_type = tensor_type(matrix.with_dtype(v.dtype), elem)
        into = f"{tensor_type(v.type, elem)} into {matrix_type}"
        return em.op(f"tensor.collapse_shape {leaf} [[{rows}], [{rank - 1}]] : {into}"), matrix_type

    @staticmethod
    def _window(em, tensor: str, ttype: str, v: Value, dims, window: TensorType, offsets) -> tuple[str, str]:
        """(tensor, type) of the part of leaf `v` (read as `tensor` of type `ttype` through `dims`,
        `_FusionLowering._read_dims`) that `window` reads: along each loop dimension that the
        window cuts (images, output rows) and the leaf does not broadcast, the window's offset and
        extent; the rest whole."""
        starts, sizes = [], []
        for d, extent in dims:
            cut = extent != 1 and window.shape[d] != extent
            starts.append(offsets[d] if cut else "0")
            sizes.append(window.shape[d] if cut else extent)
        if [e for _, e in dims] == sizes:
            return tensor, ttype
        part = tensor_type(TensorType(tuple(sizes), v.dtype), memory_elem_type(v.dtype))
        where = f"[{', '.join(map(str, starts))}] [{', '.join(map(str, sizes))}] [{', '.join(['1'] * len(sizes))}]"
        return em.op(f"tensor.extract_slice {tensor}{where} : {ttype} to {part}"), part
