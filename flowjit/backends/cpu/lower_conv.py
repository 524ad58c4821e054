"""CPU lowering of conv2d. Windows of few taps are one `linalg.generic` over (n, o, oh, ow, c, kh, kw)
(`contraction.contraction_generic`); sums of at least `IM2COL_MIN_DEPTH` taps are im2col + the
matmul kernel (`_conv_as_matmul`), over chunks of the column matrix split over the cores, im2col
padding the input as it reads where it can (`_im2col_pads`); weight gradients (short output rows,
long kernel rows) are summed over chunks of their taps (`_conv_over_taps`). A fusion's epilogue
goes through each chunk's product as it is copied out (`contraction.Epilogue`). Choices and
measurements: docs/cpu-kernels.md ("conv2d").
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from flowjit.backends.cpu import host, matmul_kernel, matmul_packing, matmul_plan, schedule
from flowjit.backends.cpu.contraction import (
    Epilogue,
    accumulator_elem,
    combine,
    const,
    contraction_generic,
    narrow,
    widen_tensor,
)
from flowjit.backends.cpu.loop_writer import LoopWriter
from flowjit.backends.cpu.row_writers import close_loops, row_major_strides, transpose, window_rows
from flowjit.backends.cpu.target import SCRATCH, lowering
from flowjit.backends.mlir.emitter import KernelEmitter, elem_type, tensor_type
from flowjit.backends.mlir.lower_movement import fill, pad_tensor, reshape
from flowjit.ir.graph import Op
from flowjit.ir.ops.contraction import conv_params
from flowjit.ir.types import TensorType


@lowering("conv2d")
def lower_conv2d(em: KernelEmitter, op: Op, operands: list[str], epilogue: Epilogue | None = None) -> list[str]:
    """Zero-pad the input, then one generic whose input map applies stride and dilation:
    out[n, o, oh, ow] += x[n, c, oh*s0 + kh*d0, ow*s1 + kw*d1] * w[o, c, kh, kw]; or, for sums of
    at least IM2COL_MIN_DEPTH taps, im2col + the matmul kernel (`_conv_as_matmul`), whose im2col
    pads as it reads where it can (`_im2col_pads`: no padded copy). With `epilogue`
    (`streams_epilogue`), the result is the epilogue's, applied to each chunk of the im2col form's
    output as it is copied out (to the whole product after the generic)."""
    x, w = operands
    tx, tw, result = op.operands[0].type, op.operands[1].type, op.result.type
    stride, padding, dilation = conv_params(op.attrs)
    padded_type, padded = tx, x
    depth = tw.size // tw.shape[0]
    if depth >= IM2COL_MIN_DEPTH and _im2col_pads(tx, tw, result, stride, padding):
        conv = (w, tw, stride, dilation, padding)
        return [_conv_as_matmul(em, x, tx, conv, result, epilogue)]
    if any(lo or hi for lo, hi in padding):
        padded_type = tx.with_shape(tx.shape[:2] + tuple(d + lo + hi for d, (lo, hi) in zip(tx.shape[2:], padding)))
        zero = const(em, 0, tx.dtype)
        padded = pad_tensor(em, x, tx, padded_type, zero, (0, 0, padding[0][0], padding[1][0]), (0, 0, 0, 0))
    if depth >= IM2COL_MIN_DEPTH:
        return [_conv_as_matmul(em, padded, padded_type, (w, tw, stride, dilation, None), result, epilogue)]
    # Loops (n, o, oh, ow, c, kh, kw), reductions innermost: LLVM unrolls the small window into
    # one register accumulator per output and vectorizes across outputs. (With `ow` innermost the
    # output row goes through memory once per tap, an order of magnitude slower.)
    x_exprs = f"d0, d4, d2 * {stride[0]} + d5 * {dilation[0]}, d3 * {stride[1]} + d6 * {dilation[1]}"
    iterators = ["parallel"] * 4 + ["reduction"] * 3
    inputs = [(padded, padded_type, x_exprs), (w, tw, "d1, d4, d5, d6")]
    product = contraction_generic(em, inputs, result, iterators, depth)
    return [epilogue.apply(em, product, False, result, None, None, False) if epilogue else product]


# Convolutions summing over at least this many (c, kh, kw) taps go through im2col + the matmul
# kernel: the generic's reduction is one scalar add chain per output (no reassociation), slower
# even for a 3x3 window (the CNN's 1x28x28 -> 32 layer takes 1.6x the time on one core of a 2-core
# AMD EPYC Zen 4 VM) and latency-bound for deep ones.
IM2COL_MIN_DEPTH = 8

# The column matrix is a temporary of depth x (columns of the chunk) elements, made and consumed
# per chunk: runs of whole images while they fit, else blocks of output rows of one image. A chunk
# larger than the caches goes through memory three times (im2col, packing, product), and one too
# large to reuse is mapped fresh and page-faulted every call. At 128K elements (512 KiB of
# float32) a chunk stays in a core's L2 (1 MiB) while the kernel packs it: 2-7% faster than 512K
# over five conv shapes (2-core AMD EPYC Zen 4 VM). But only when that is at least
# IM2COL_MIN_COLUMNS columns: deeper convs keep WIDE_CHUNK_ELEMENTS, since narrower chunks run
# slower and larger ones no longer split evenly over the cores. See docs/cpu-kernels.md ("conv2d").
IM2COL_MAX_ELEMENTS = 1 << 17

IM2COL_MIN_COLUMNS = 112

# The chunks of deeper convs, those that decide whether a conv is summed over taps (`over_taps`),
# and those of a 1x1 conv (its columns are views of the input, so a chunk is only a share of the
# work per core, and smaller chunks only add overhead) keep the wider cap.
WIDE_CHUNK_ELEMENTS = 1 << 19

# A chunk's product (O x columns), which an epilogue reads back, stays under this many elements
# (512 KiB of float32, half a Zen 4 core's L2) (`_epilogue_cap`).
EPILOGUE_PRODUCT_ELEMENTS = 1 << 17


@dataclass(frozen=True)
class _Conv:
    """One convolution's im2col form: its (O, C*KH*KW) weights in the accumulator type `acc`, their
    4-D type `tw`, stride, dilation, and the epilogue its output goes through (None: the product
    in `acc`, narrowed to the result's type at the end)."""

    weights: str | matmul_packing.Restrided  # restrided for a fork's chunks (`_restrides_weights`)
    tw: TensorType
    stride: tuple
    dilation: tuple
    acc: str
    epilogue: Epilogue | None
    padding: tuple | None = None  # the input's, when im2col pads as it reads (`_im2col_pads`)

    @property
    def out_elem(self) -> str:
        """The element of the output tensor being filled: the epilogue's, else the accumulator."""
        return self.epilogue.elem if self.epilogue is not None else self.acc

    def finish(self, em: KernelEmitter, out: str, result: TensorType) -> str:
        return out if self.epilogue is not None else narrow(em, out, result, self.acc)

    def out(self, part: TensorType) -> TensorType:
        """The part of the output tensor that conv output `part` fills (pooled by the epilogue)."""
        return part.with_shape(self.epilogue.out_shape(part.shape)) if self.epilogue is not None else part

    @property
    def row_step(self) -> int:
        """Conv output rows per output row: the pool's window height (chunks of rows are its multiples)."""
        pool = self.epilogue.pool if self.epilogue is not None else None
        return pool["window"][2] if pool is not None else 1

    def out_slice(self, w_, image: str, row: str, part: TensorType) -> str:
        """The `[offsets] [sizes] [strides]` of the output that conv output rows `part` from (image, row) fill."""
        if self.row_step > 1:
            row = w_.em.op(f"arith.divui {row}, {w_.index(self.row_step)} : index")
        return f"[{image}, 0, {row}, 0] [{', '.join(map(str, self.out(part).shape))}] [1, 1, 1, 1]"


def _restrides_weights(o: int, depth: int, acc: str) -> bool:
    """Whether the weights' rows are copied one cache line apart before the chunks' fork: rows a
    multiple of 4 KiB long (`matmul_plan.ALIASING_STRIDE`; 1x1 convs over 1024 or 2048 channels),
    which the products of the chunks, serial, would read in place at about half the speed
    (`matmul_plan.ALIASING_STRIDE` says why; docs/cpu-kernels.md, "conv2d")."""
    return o >= matmul_plan.SHORT_TILE_ROWS and matmul_plan.aliases(depth, acc)


def _conv2d_scratch(op: Op) -> int:
    """The weights' restrided copy (`_restrides_weights`), when the conv may take the im2col form."""
    tw = op.operands[1].type
    o, depth, acc = tw.shape[0], tw.size // tw.shape[0], accumulator_elem(op.result.type.dtype)
    return matmul_plan.restrided_bytes(o, depth, acc) if _restrides_weights(o, depth, acc) else 0


SCRATCH["conv2d"] = _conv2d_scratch


def _im2col_cap(depth: int) -> int:
    """Elements of an im2col chunk's column matrix for a sum over `depth` taps (see IM2COL_MAX_ELEMENTS)."""
    return IM2COL_MAX_ELEMENTS if depth * IM2COL_MIN_COLUMNS <= IM2COL_MAX_ELEMENTS else WIDE_CHUNK_ELEMENTS


def _epilogue_cap(cap: int, conv: _Conv, o: int) -> int:
    """`cap` for the chunks of a conv with an epilogue, lowered so that a chunk's product (O x its
    columns) also stays under EPILOGUE_PRODUCT_ELEMENTS: the epilogue (and its pool) reads it back
    from L2. A shallow conv's product is the larger: 1 -> 32 channels 3x3 makes 32 outputs from 9
    taps; the CNN's conv + bias + relu + 2x2 max pooling (64 x 1 x 28 x 28) runs faster in chunks of
    4 images, whose product stays in L2, than of 16."""
    if conv.epilogue is None:
        return cap
    depth = conv.tw.size // o
    return min(cap, depth * max(1, EPILOGUE_PRODUCT_ELEMENTS // o))


def _conv_chunk(n: int, oh: int, depth: int, ow: int, cap: int) -> tuple[int, int]:
    """(images, output rows) per chunk of at most `cap` elements of the column matrix: all rows of
    as many images as fit, else one image's rows in blocks that fit, preferring a block height that
    divides OH when one is at least half the largest that fits (no tail block)."""
    per_image = depth * oh * ow
    if per_image <= cap:
        return max(1, min(n, cap // per_image)), oh
    rows = max(1, cap // (depth * ow))
    divisor = max(d for d in range(1, rows + 1) if oh % d == 0)
    return 1, divisor if 2 * divisor >= rows else rows


def _whole_images(n: int, fit: int) -> int:
    """Images per chunk when `fit` of the `n` fit in one: a divisor of `n` of at least half `fit`
    when there is one, so that no tail chunk repeats the chunk's code (im2col, packing, product,
    epilogue) for the images left over, and of those one giving a number of chunks the cores share
    evenly (then they run in one fork), the largest. The CNN's 64 x 1 x 28 x 28 3x3 conv, for
    instance, takes chunks of 16 images, four chunks on two cores, rather than three chunks of 18
    and a tail of 10 whose code is a second copy of the chunk's."""
    whole = [d for d in range(max(1, fit // 2), fit + 1) if n % d == 0]
    shared = [d for d in whole if (n // d) % host.cores() == 0]
    return max(shared or whole, default=fit)


def _conv_as_matmul(em: KernelEmitter, padded: str, padded_type: TensorType, conv, result, epilogue) -> str:
    """conv2d as W (O, C*KH*KW) @ cols (C*KH*KW, N*OH*OW) (see `_conv_images`), over chunks whose
    column matrix fits IM2COL_MAX_ELEMENTS (`_conv_chunk`). With several cores and at least as many
    whole chunks as cores, the chunks are split over the cores (each thread makes its chunk's
    columns and multiplies them on its own, so the im2col and the copies run in parallel too, with
    one fork for the whole convolution); otherwise chunk after chunk, each product on all cores.
    With an `epilogue`, each chunk's product goes through it into its window of the output. `conv`
    = (weights, their type, stride, dilation, padding): padding None when `padded` is the padded
    input, else that of the unpadded input, which im2col pads as it reads (`_im2col_pads`)."""
    w, tw, stride, dilation, padding = conv
    n, o, oh, ow = result.shape
    depth = tw.size // o
    acc = accumulator_elem(result.dtype)
    weights = reshape(em, widen_tensor(em, w, tw, acc), tw, (o, depth), acc)
    conv = _Conv(weights, tw, stride, dilation, acc, epilogue, padding)
    if over_taps(tw, result):
        return conv.finish(em, _conv_over_taps(em, (padded, padded_type), conv, result), result)
    images, rows = _conv_chunk(n, oh, depth, ow, WIDE_CHUNK_ELEMENTS)
    if _pointwise(tw, stride, padded_type):
        images = 1 if n > 1 else images  # each image's own view is its column matrix (`_pointwise_columns`)
    else:
        images, rows = _conv_chunk(n, oh, depth, ow, _epilogue_cap(_im2col_cap(depth), conv, o))
        if rows == oh and images < n:
            images = _whole_images(n, images)
    if rows < oh:  # blocks of rows that pool on their own
        rows = max(conv.row_step, rows // conv.row_step * conv.row_step)
    w_ = LoopWriter(em)
    whole = n // images if rows == oh else n * (oh // rows)  # whole chunks
    threads = host.cores()
    if threads < 2 or whole < threads or (whole < 2 * threads and whole % threads):
        if images == n and rows == oh:
            return conv.finish(em, _conv_images(em, (padded, padded_type), conv, result), result)
        return conv.finish(
            em, _conv_chunks_in_turn(em, w_, (padded, padded_type), conv, result, (images, rows)), result
        )
    in_fork = conv
    if _restrides_weights(o, depth, acc):
        # Before the fork, for the chunks' products inside it: serial, they have no scratch area
        # of their own (the tail chunks after it are not, and restride the weights themselves).
        copier = LoopWriter.with_scratch(em, matmul_plan.restrided_bytes(o, depth, acc))
        source = (conv.weights, f"tensor<{o}x{depth}x{acc}>", [])
        weights = matmul_packing.restride(copier, source, o, depth, acc, copier.index(0), threads)
        in_fork = dataclasses.replace(conv, weights=weights)
    out_type = tensor_type(conv.out(result), conv.out_elem)
    done, t, shared = w_.open_forall(whole, em.empty(conv.out(result), conv.out_elem), out_type)
    if rows == oh:
        image, row = w_.mul(t, w_.index(images)), w_.index(0)
    else:
        per_image = w_.index(oh // rows)
        image = em.op(f"arith.divui {t}, {per_image} : index")
        row = w_.mul(em.op(f"arith.remui {t}, {per_image} : index"), w_.index(rows))
    part = result.with_shape((images, o, rows, ow))
    where = conv.out_slice(w_, image, row, part)
    part_type = tensor_type(conv.out(part), conv.out_elem)
    into = em.op(f"tensor.extract_slice {shared}{where} : {out_type} to {part_type}")
    scratch, em.scratch = em.scratch, None  # the shared scratch area is no thread's own: allocate
    y = _conv_images(em, (padded, padded_type), in_fork, part, (image, row), serial=True, into=into)
    em.scratch = scratch
    w_.close_forall(y, shared, where, part_type, out_type)
    if rows == oh and n % images:  # the tail chunk of images
        done = _conv_chunk_into(
            em, (padded, padded_type), conv, result, done, (w_.index(whole * images), n % images, w_.index(0), oh)
        )
    elif rows < oh and oh % rows >= conv.row_step:  # each image's tail block of rows (a whole pooling window)
        first = w_.index(oh // rows * rows)
        tail = lambda image, _, into: _conv_chunk_into(
            em, (padded, padded_type), conv, result, into, (image, 1, first, oh % rows)
        )
        done = _blocks(w_, 1, n, tail, done, out_type)
    return conv.finish(em, done, result)


def _conv_chunks_in_turn(em: KernelEmitter, w_, source, conv, result: TensorType, chunk: tuple[int, int]) -> str:
    """The chunks one after another (each product on all cores): loops over whole chunks, then tails."""
    n, oh = result.shape[0], result.shape[2]
    images, rows = chunk
    out_type = tensor_type(conv.out(result), conv.out_elem)
    empty = em.empty(conv.out(result), conv.out_elem)

    def chunk_into(image, count, row, height, into):
        return _conv_chunk_into(em, source, conv, result, into, (image, count, row, height))

    if rows == oh:  # runs of whole images
        return _blocks(
            w_, images, n, lambda first, count, into: chunk_into(first, count, w_.index(0), oh, into), empty, out_type
        )

    def image_rows(first, _, into):
        return _blocks(
            w_, rows, oh, lambda row, height, inner: chunk_into(first, 1, row, height, inner), into, out_type
        )

    return _blocks(w_, 1, n, image_rows, empty, out_type)


def _blocks(w_, size: int, total: int, emit, into: str, out_type: str) -> str:
    """`into` after `emit(first, count, into)` over the whole blocks of `size` (a loop), then the tail."""
    full = total // size
    if full == 1 and total == size:
        return emit(w_.index(0), size, into)
    loop, i, (carried,) = w_.open_for(w_.index(0), w_.index(full), w_.index(1), [(into, out_type)])
    w_.close_for([emit(w_.mul(i, w_.index(size)), size, carried)], [out_type])
    return loop if total % size == 0 else emit(w_.index(full * size), total % size, loop)


def _conv_chunk_into(em: KernelEmitter, source, conv, result: TensorType, into: str, chunk) -> str:
    """`into` with the output rows [row, row + height) of images [image, image + count) computed
    (`row` a multiple of the epilogue's pool height; rows past its last whole window are left out)."""
    image, count, row, height = chunk
    part = result.with_shape((count, result.shape[1], height, result.shape[3]))
    if conv.out(part).size == 0:  # a tail shorter than a pooling window
        return into
    where = conv.out_slice(LoopWriter(em), image, row, part)
    part_type, out_type = tensor_type(conv.out(part), conv.out_elem), tensor_type(conv.out(result), conv.out_elem)
    window = em.op(f"tensor.extract_slice {into}{where} : {out_type} to {part_type}")
    y = _conv_images(em, source, conv, part, (image, row), into=window)
    return em.op(f"tensor.insert_slice {y} into {into}{where} : {part_type} into {out_type}")


def _conv_images(
    em: KernelEmitter, source, conv, result: TensorType, origin=None, serial: bool = False, into=None
) -> str:
    """The convolution in the accumulator type of the images and output rows `result` covers, from
    image and output row `origin` (index values; the first ones when None) of the padded input
    `source` = (tensor, type): cols[c, kh, kw, n, oh, ow] = x[n, c, oh*s0 + kh*d0, ow*s1 + kw*d1]
    (`_im2col`), the matmul kernel's W @ cols as (O, N, OH, OW), transposed to NCHW (a reshape for
    one image), or, with the convolution's epilogue, its result (computed `into` that tensor when
    given). `serial`: the product stays on the calling thread."""
    weights, tw, stride, dilation, acc = conv.weights, conv.tw, conv.stride, conv.dilation, conv.acc
    n, o, oh, ow = result.shape
    c, kh, kw = tw.shape[1:]
    depth, columns = c * kh * kw, n * oh * ow
    in_place = False  # the kernel reads the columns where they are (`MatmulShape.b_in_place`)
    if _pointwise(tw, stride, source[1]) and n == 1:  # the image's rows are the columns already
        cols = _pointwise_columns(em, source, origin, columns, acc)
    else:
        in_place = serial and depth * columns <= IM2COL_MAX_ELEMENTS  # just written, in L2
        cols_type = TensorType((c, kh, kw, n, oh, ow), result.dtype)
        if conv.padding is not None:
            cols = _im2col_padding(em, source, cols_type, conv, origin)
        else:
            cols = _im2col(em, source, cols_type, stride, dilation, acc, origin)
        cols = reshape(em, cols, TensorType((cols_type.size,), result.dtype), (depth, columns), acc)
    shape = matmul_plan.MatmulShape(0, o, columns, depth, acc, serial=serial, b_in_place=in_place)
    if n == 1 and conv.epilogue is None and into is not None:
        # One image's rows: the product is its window of the output, (O, rows x OW) in place. As a
        # product of its own, reshaped to the window, it was a temporary copied into the output
        # (a strided copy, the one plain loop that kept such a conv on LLVM's O3).
        four = f"tensor<1x{o}x{oh}x{ow}x{acc}>"
        view = em.op(f"tensor.collapse_shape {into} [[0, 1], [2, 3]] : {four} into tensor<{o}x{columns}x{acc}>")
        product = matmul_kernel.emit_matmul(em, weights, cols, shape, out=view)
        return em.op(
            f"tensor.expand_shape {product} [[0, 1], [2, 3]] output_shape [1, {o}, {oh}, {ow}] "
            f": tensor<{o}x{columns}x{acc}> into {four}"
        )
    product = matmul_kernel.emit_matmul(em, weights, cols, shape)
    if n == 1 and conv.epilogue is None:
        return reshape(em, product, TensorType((o, columns), result.dtype), result.shape, acc)
    onhw = TensorType((o, n, oh, ow), result.dtype)
    product = reshape(em, product, TensorType((o, columns), result.dtype), onhw.shape, acc)
    if conv.epilogue is not None:
        return conv.epilogue.apply(em, product, True, result, origin, into, serial)
    return transpose(em, product, onhw, [1, 0, 2, 3], acc, into)[0]


# A chunk of whole images with fewer columns than this leaves the matmul kernel's panels (32
# columns for float32) mostly empty; convolutions with short output rows and long kernel rows are
# then summed over chunks of their taps instead (`_conv_over_taps`).
TAPS_FORM_MAX_COLUMNS = 128

# ... while each thread's partial sum (O x N*OH*OW) stays under this many elements.
TAPS_FORM_MAX_OUTPUT = 1 << 21


def over_taps(tw: TensorType, result: TensorType) -> bool:
    """Whether `_conv_over_taps` computes this convolution: output rows shorter than the kernel's
    (a weight gradient: the forward's kernel is its output, the forward's output its kernel) and
    chunks of whole images (of `WIDE_CHUNK_ELEMENTS`) too narrow for the matmul kernel."""
    n, _, oh, ow = result.shape
    images, rows = _conv_chunk(n, oh, tw.size // tw.shape[0], ow, WIDE_CHUNK_ELEMENTS)
    return ow < tw.shape[3] and images * rows * ow < TAPS_FORM_MAX_COLUMNS and result.size <= TAPS_FORM_MAX_OUTPUT


def _conv_over_taps(em: KernelEmitter, source, conv, result: TensorType) -> str:
    """The convolution as a sum over chunks of its taps: out (O, N*OH*OW) = sum over chunks of
    W[:, chunk] @ rows[:, chunk]^T, where rows[(n, oh, ow), (c, kh, kw)] = x[n, c, oh*s0 + kh*d0,
    ow*s1 + kw*d1] (`_im2row`: along kernel rows, which are long here, unlike the output rows) and
    a chunk is a run of (c, kh) pairs. The matmul kernel adds each chunk's product to the running
    sum (`MatmulShape.accumulate`). On several cores each thread sums its share of the chunks into
    its own partial sum (one fork), and the partial sums are added at the end. This suits a conv
    with many taps and few outputs, such as the weight gradient of a 3x3 conv over 8x64x56x56
    (O x N*OH*OW = 64 x 576, 25,088 taps), where chunks of images would be narrow (two images, 18
    columns each) and nearly twice as slow (docs/cpu-kernels.md, "conv2d")."""
    weights, tw, stride, dilation, acc = conv.weights, conv.tw, conv.stride, conv.dilation, conv.acc
    n, o, oh, ow = result.shape
    c, kh, kw = tw.shape[1:]
    columns = n * oh * ow
    fit = max(1, WIDE_CHUNK_ELEMENTS // (columns * kw))
    pairs = max(d for d in range(1, min(c * kh, fit) + 1) if (c * kh) % d == 0)  # (c, kh) pairs per chunk
    chunks, taps = c * kh // pairs, pairs * kw
    threads = max(1, min(host.cores(), chunks))
    per = -(-chunks // threads)
    threads = -(-chunks // per)
    w_ = LoopWriter(em)
    sum_t = TensorType((o, columns), result.dtype)
    sum_type = tensor_type(sum_t, acc)

    def add_chunk(chunk: str, into: str, serial: bool) -> str:
        first = w_.mul(chunk, w_.index(pairs))
        rows = _im2row(em, source, (n, oh, ow), (kh, kw), (first, pairs), stride, dilation, acc)
        a = em.op(
            f"tensor.extract_slice {weights}[0, {w_.mul(first, w_.index(kw))}] [{o}, {taps}] [1, 1] "
            f": tensor<{o}x{c * kh * kw}x{acc}> to tensor<{o}x{taps}x{acc}>"
        )
        shape = matmul_plan.MatmulShape(0, o, columns, taps, acc, b_rows=True, serial=serial, accumulate=True)
        return matmul_kernel.emit_matmul(em, a, rows, shape, into)

    def chunk_loop(lo: str, hi: str, serial: bool) -> str:
        zero = fill(em, const(em, 0, acc), sum_t, acc)
        loop, i, (partial,) = w_.open_for(lo, hi, w_.index(1), [(zero, sum_type)])
        w_.close_for([add_chunk(i, partial, serial)], [sum_type])
        return loop

    if threads == 1:
        total = chunk_loop(w_.index(0), w_.index(chunks), False)
    else:
        parts_type = f"tensor<{threads}x{o}x{columns}x{acc}>"
        empty = em.empty(TensorType((threads, o, columns), result.dtype), acc)
        parts, t, shared = w_.open_forall(threads, empty, parts_type)
        lo = w_.mul(t, w_.index(per))
        hi = em.op(f"arith.minsi {w_.add(lo, w_.index(per))}, {w_.index(chunks)} : index")
        scratch, em.scratch = em.scratch, None  # the shared scratch area is no thread's own: allocate
        partial = chunk_loop(lo, hi, True)
        em.scratch = scratch
        w_.close_forall(partial, shared, f"[{t}, 0, 0] [1, {o}, {columns}] [1, 1, 1]", sum_type, parts_type)
        ident = em.identity_map(2)
        where = f"[1, {o}, {columns}] [1, 1, 1] : {parts_type} to {sum_type}"
        slices = [em.op(f"tensor.extract_slice {parts}[{k}, 0, 0] {where}") for k in range(threads)]
        total = em.generic(
            [(part, sum_type) for part in slices],
            (em.empty(sum_t, acc), sum_type),
            [ident] * (threads + 1),
            ["parallel", "parallel"],
            lambda b, args: functools.reduce(
                lambda total, part: combine(b, "sum", total, part, acc, acc.startswith("i")), args[1:threads], args[0]
            ),
            [acc] * threads,
            acc,
        )
        if sum_t.size > schedule.PLAIN_LOOP_MAX_ELEMENTS:  # vector code: as plain loops, only LLVM's O3 vectorizes
            em.schedule(total, schedule.copy_nd(sum_t.shape, int(acc[1:]), False))
    onhw = TensorType((o, n, oh, ow), result.dtype)
    total = reshape(em, total, sum_t, onhw.shape, acc)
    if conv.epilogue is not None:
        return conv.epilogue.apply(em, total, True, result, None, None, False)
    return transpose(em, total, onhw, [1, 0, 2, 3], acc)[0]


def _im2row(em: KernelEmitter, source, out_dims, kernel, pairs, stride, dilation, acc) -> str:
    """rows[(n, oh, ow), (p, kw)] = x[n, c, oh*s0 + kh*d0, ow*s1 + kw*d1] for the `pairs` = (first,
    count) run of (c, kh) pairs (c = p // KH, kh = p % KH), as a (N*OH*OW, count*KW) tensor: per
    output position and pair, the KW taps along one input row (`window_rows`)."""
    n, oh, ow = out_dims
    kh, kw = kernel
    first, count = pairs
    strides = row_major_strides(source[1].shape)
    width = count * kw

    def pair_offsets(w, q: str) -> tuple[str, str]:
        pair = w.add(first, q)
        channel = w.em.op(f"arith.divui {pair}, {w.index(kh)} : index")
        kernel_row = w.em.op(f"arith.remui {pair}, {w.index(kh)} : index")
        read = w.add(w.mul(channel, w.index(strides[1])), w.mul(kernel_row, w.index(dilation[0] * strides[2])))
        return read, w.mul(q, w.index(kw))

    levels = [
        (n, (strides[0], oh * ow * width)),
        (oh, (stride[0] * strides[2], ow * width)),
        (ow, (stride[1], width)),
        (count, pair_offsets),
    ]
    rows = window_rows(em, source, n * oh * ow * width, levels, (kw, dilation[1]), acc)
    return reshape(em, rows, TensorType((n * oh * ow * width,), source[1].dtype), (n * oh * ow, width), acc)


def _pointwise(tw: TensorType, stride, padded_type: TensorType) -> bool:
    """A 1x1 convolution with stride 1 over an input in the accumulator type: one image's
    (C, H*W) view is its column matrix (a chunk of it, a block of its rows), so no im2col."""
    return (
        tw.shape[2:] == (1, 1)
        and tuple(stride) == (1, 1)
        and elem_type(padded_type.dtype) == accumulator_elem(padded_type.dtype)
    )


def _pointwise_columns(em: KernelEmitter, source, origin, columns: int, acc: str) -> str:
    """The columns of a pointwise convolution's chunk: the (C, columns) view of image n0 from output
    row oh0 on (`origin`; the first image and row when None), a strided slice of the input."""
    x, t = source
    n, c, h, w = t.shape
    flat = reshape(em, x, t, (n, c, h * w), acc)
    image, row = origin if origin is not None else (em.op("arith.constant 0 : index"),) * 2
    first = em.op(f"arith.muli {row}, {em.op(f'arith.constant {w} : index')} : index")
    view = f"tensor<{c}x{columns}x{acc}>"
    return em.op(
        f"tensor.extract_slice {flat}[{image}, 0, {first}] [1, {c}, {columns}] [1, 1, 1] "
        f": tensor<{n}x{c}x{h * w}x{acc}> to {view}"
    )


def _im2col(em: KernelEmitter, source, cols_type: TensorType, stride, dilation, acc, origin=None):
    """cols[c, kh, kw, n, oh, ow] = x[n0 + n, c, (oh0 + oh)*s0 + kh*d0, ow*s1 + kw*d1] as a flat
    tensor, (n0, oh0) = `origin` (index values, or the first image and row), x = `source` (the
    padded input, (tensor, type)), one output row (fixed c, kh, kw, n, oh) at a time
    (`window_rows`). (A 6-D generic computes the same, but LLVM spends far longer compiling its
    unrolled small loops.)"""
    c, kh, kw, n, oh, ow = cols_type.shape
    strides = row_major_strides(source[1].shape)

    def base(w) -> str:  # the chunk's first image and output row
        return w.add(w.mul(origin[0], w.index(strides[0])), w.mul(origin[1], w.index(stride[0] * strides[2])))

    # (bound, (input elements, output elements) per step) of the c, kh, kw, n, oh loops
    levels = [
        (c, (strides[1], kh * kw * n * oh * ow)),
        (kh, (dilation[0] * strides[2], kw * n * oh * ow)),
        (kw, (dilation[1], n * oh * ow)),
        (n, (strides[0], oh * ow)),
        (oh, (stride[0] * strides[2], ow)),
    ]
    return window_rows(em, source, cols_type.size, levels, (ow, stride[1]), acc, base if origin else None)


def _im2col_pads(tx: TensorType, tw: TensorType, result: TensorType, stride, padding) -> bool:
    """Whether im2col reads the unpadded input and pads as it reads (`_im2col_padding`), so that no
    padded copy of the input is made: a padded convolution with stride 1 along the rows, rows of
    input and output at least a vector long, at most a vector of padding on either side of a row,
    and the plain im2col form (not the sum over taps, not a 1x1 conv)."""
    lanes = host.vector_bits() // int(accumulator_elem(result.dtype)[1:])
    ow = result.shape[3]
    return (
        any(lo or hi for lo, hi in padding)
        and stride[1] == 1
        and min(tx.shape[3], ow) >= lanes
        and max(padding[1]) <= lanes
        and tw.shape[2:] != (1, 1)
        and not over_taps(tw, result)
    )


def _im2col_padding(em: KernelEmitter, source, cols_type: TensorType, conv, origin=None) -> str:
    """`_im2col` of the unpadded input `source`, zero outside it (conv.padding, `_im2col_pads`):
    per row (c, kh, n, oh) the input row ih = (oh0 + oh)*s0 + kh*d0 - top, read clamped into the
    input and zeroed when outside it; per kernel column kw (written out) the row's vectors at
    columns 0, lanes, 2*lanes, ... and OW - lanes (the last overlapping the one before) read
    input columns q + kw*d1 - left: a run of three or more vectors wholly inside the input row is
    one loop of plain reads; each other vector (at most a vector of padding: the first ones and
    the last ones) reads from a start clamped into the row, its lanes moved into place and the
    ones outside the row zeroed by one constant shuffle (none when it lies inside)."""
    x, t = source
    c, kh, kw, n, oh, ow = cols_type.shape
    _, _, height, width = t.shape
    (top, _), (left, _) = conv.padding
    stride, dilation, acc = conv.stride, conv.dilation, conv.acc
    elem = elem_type(t.dtype)
    lanes = host.vector_bits() // int(acc[1:])
    strides = row_major_strides(t.shape)
    flat_in = TensorType((t.size,), t.dtype)
    flat_source = reshape(em, x, t, flat_in.shape)
    flat_t = TensorType((cols_type.size,), cols_type.dtype)
    flat_type = tensor_type(flat_t, acc)
    w = LoopWriter(em)
    vec, wide = f"vector<{lanes}x{elem}>", f"vector<{lanes}x{acc}>"
    zero_in = em.op(f"arith.constant dense<0.0> : {vec}")
    zero_out = em.op(f"arith.constant dense<0.0> : {wide}")
    pad = em.op(f"arith.constant 0.0 : {elem}")
    plane = n * oh * ow  # elements of the column matrix per (c, kh, kw)
    origin = origin or (w.index(0), w.index(0))
    carried, loops = em.empty(flat_t, acc), []
    ivs = []
    for bound in (c, kh, n, oh):
        loop, iv, (carried,) = w.open_for(w.index(0), w.index(bound), w.index(1), [(carried, flat_type)])
        loops.append(loop)
        ivs.append(iv)
    ci, khi, ni, ohi = ivs
    row = em.op(
        f"arith.subi {w.add(w.mul(w.add(origin[1], ohi), w.index(stride[0])), w.mul(khi, w.index(dilation[0])))}, "
        f"{w.index(top)} : index"
    )
    inside = em.op(
        f"arith.andi {em.op(f'arith.cmpi sge, {row}, {w.index(0)} : index')}, "
        f"{em.op(f'arith.cmpi slt, {row}, {w.index(height)} : index')} : i1"
    )
    clamped = em.op(f"arith.minsi {em.op(f'arith.maxsi {row}, {w.index(0)} : index')}, {w.index(height - 1)} : index")
    image = w.add(origin[0], ni)
    row_start = w.add(
        w.add(w.mul(image, w.index(strides[0])), w.mul(ci, w.index(strides[1]))), w.mul(clamped, w.index(strides[2]))
    )
    out_row = w.add(
        w.add(w.mul(w.add(w.mul(ci, w.index(kh)), khi), w.index(kw * plane)), w.mul(ni, w.index(oh * ow))),
        w.mul(ohi, w.index(ow)),
    )
    steps = -(-ow // lanes)
    columns = [min(j * lanes, ow - lanes) for j in range(steps)]

    in_type = tensor_type(flat_in)

    def vector_at(column: int | str, shift: int) -> str:
        """The row's vector at output column `column` (an index value: a middle vector) for kernel
        column offset `shift`."""
        picks = list(range(lanes))
        if isinstance(column, str):  # inside the row
            where = w.add(row_start, w.add(column, w.index(shift)))
        else:
            first = column + shift
            start = min(max(first, 0), width - lanes)
            where = w.add(row_start, w.index(start))
            picks = [first + lane - start if 0 <= first + lane < width else lanes for lane in range(lanes)]
        v = em.op(f"vector.transfer_read {flat_source}[{where}], {pad} {{in_bounds = [true]}} : {in_type}, {vec}")
        if picks != list(range(lanes)):
            v = em.op(f"vector.shuffle {v}, {zero_in} [{', '.join(map(str, picks))}] : {vec}, {vec}")
        if elem != acc:
            v = em.op(f"arith.extf {v} : {vec} to {wide}")
        return em.op(f"arith.select {inside}, {v}, {zero_out} : {wide}")

    cur = carried
    for k in range(kw):
        shift = k * dilation[1] - left
        out = w.add(out_row, w.index(k * plane))
        # Vectors wholly inside the input row, at multiples of lanes: a run of them is one loop.
        plain = [j for j in range(steps) if columns[j] == j * lanes and 0 <= columns[j] + shift <= width - lanes]
        run = (plain[0], plain[-1] + 1) if len(plain) > 2 else (0, 0)
        for j in range(steps):
            if not run[0] <= j < run[1]:
                cur = em.op(
                    f"vector.transfer_write {vector_at(columns[j], shift)}, {cur}[{w.add(out, w.index(columns[j]))}] "
                    f"{{in_bounds = [true]}} : {wide}, {flat_type}"
                )
        if run[1] > run[0]:
            loop, j, (inner,) = w.open_for(w.index(run[0]), w.index(run[1]), w.index(1), [(cur, flat_type)])
            column = w.mul(j, w.index(lanes))
            inner = em.op(
                f"vector.transfer_write {vector_at(column, shift)}, {inner}[{w.add(out, column)}] "
                f"{{in_bounds = [true]}} : {wide}, {flat_type}"
            )
            w.close_for([inner], [flat_type])
            cur = loop
    return close_loops(w, cur, flat_type, loops)
