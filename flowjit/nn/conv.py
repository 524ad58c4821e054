"""Convolution and pooling. Layouts follow PyTorch: images NCHW, sequences NCL, weights OIHW (OIL),
transposed-convolution weights (in, out / groups, kh, kw).

Only the ungrouped 2-D convolution is an IR op; conv1d is a conv2d over a height-1 image, a grouped
convolution is one conv2d per group (depthwise ones an elementwise sum over kernel taps), and a
transposed convolution is a convolution of the stride-dilated input with the flipped kernel.
"""

from __future__ import annotations

import numpy as np

from flowjit import numpy as fnp
from flowjit.errors import FlowjitTypeError, FlowjitValueError
from flowjit.frontend.trace import bind
from flowjit.ir.location import user_location
from flowjit.nn import arguments


def _pair(v, what: str) -> tuple[int, int]:
    if isinstance(v, int):
        return (v, v)
    if len(v) != 2:
        raise FlowjitValueError(f"{user_location()}: {what} must be an int or a pair; found {v!r}")
    return (int(v[0]), int(v[1]))


def _conv_padding(padding, size, kernel, stride, dilation):
    """'VALID', 'SAME', an int, a pair, or ((top, bottom), (left, right)) -> ((lo, hi), (lo, hi)).

    'SAME' is TensorFlow's and XLA's: the output has ceil(size / stride) positions and the odd pixel
    of padding goes at the end, so strided layers match models ported from those frameworks."""
    if isinstance(padding, str):
        mode = padding.upper()
        if mode == "VALID":
            return ((0, 0), (0, 0))
        if mode == "SAME":
            pads = []
            for n, k, s, d in zip(size, kernel, stride, dilation):
                total = max((-(-n // s) - 1) * s + d * (k - 1) + 1 - n, 0)
                pads.append((total // 2, total - total // 2))
            return tuple(pads)
        raise FlowjitValueError(f"{user_location()}: padding must be 'SAME', 'VALID' or numbers; found {padding!r}")
    if isinstance(padding, int):
        return ((padding, padding), (padding, padding))
    if all(isinstance(p, int) for p in padding):
        return ((padding[0], padding[0]), (padding[1], padding[1]))
    return tuple((int(lo), int(hi)) for lo, hi in padding)


def _float_operands(x, w, what: str):
    x, w = fnp.asarray(x), fnp.asarray(w)
    target = fnp.result_type(x, w)
    if not target.is_float:
        raise FlowjitTypeError(f"{user_location()}: {what} needs float inputs; found {target}")
    return fnp.astype(x, target), fnp.astype(w, target)


def _check_groups(x, w, groups: int, what: str, weight_layout: str) -> None:
    in_channels = fnp.shape(x)[1]
    out_channels = fnp.shape(w)[0]
    if groups < 1 or in_channels % groups or out_channels % groups or in_channels // groups != fnp.shape(w)[1]:
        raise FlowjitTypeError(
            f"{user_location()}: {what}: input with {in_channels} channels (shape {fnp.shape(x)}) and weights of "
            f"shape {fnp.shape(w)} ({weight_layout}) do not fit groups={groups}; expected weights of shape "
            f"(O, {in_channels // max(groups, 1)}, kh, kw) with O divisible by {groups}"
        )


def _depthwise_conv(x, w, stride, pads, dilation):
    """A convolution whose groups have one input channel each: a sum over kernel taps (i, j) of the
    tap's strided input slice times w[:, 0, i, j], elementwise, so the work does not grow with the
    number of channels. (The `fuse` pass makes the taps and multiply-adds one kernel after the pad:
    each tap is a strided view of the padded input, nothing is copied.)"""
    _, _, height, width = fnp.shape(x)
    out_channels, _, kh, kw = fnp.shape(w)
    multiplier = out_channels // fnp.shape(x)[1]
    x = fnp.pad(x, ((0, 0), (0, 0), *pads))
    spans = [size + sum(pad) - d * (k - 1) - 1 for size, pad, d, k in zip((height, width), pads, dilation, (kh, kw))]
    if min(spans) < 0:
        raise FlowjitTypeError(
            f"{user_location()}: conv2d: the {kh}x{kw} kernel (dilation {dilation}) does not fit the padded input "
            f"of shape {fnp.shape(x)}"
        )
    oh, ow = (span // s + 1 for span, s in zip(spans, stride))
    if multiplier > 1:
        x = fnp.repeat(x, multiplier, axis=1)
    out = None
    for i in range(kh):
        for j in range(kw):
            r0, c0 = i * dilation[0], j * dilation[1]
            patch = x[
                :, :, r0 : r0 + stride[0] * (oh - 1) + 1 : stride[0], c0 : c0 + stride[1] * (ow - 1) + 1 : stride[1]
            ]
            term = fnp.multiply(patch, fnp.reshape(w[:, 0, i, j], (1, out_channels, 1, 1)))
            out = term if out is None else fnp.add(out, term)
    return out


def _grouped_conv(x, w, attrs, groups):
    """One conv2d op per group on its slice of the input and output channels, concatenated."""
    group_in, group_out = fnp.shape(x)[1] // groups, fnp.shape(w)[0] // groups
    outs = [
        bind("conv2d", [x[:, g * group_in : (g + 1) * group_in], w[g * group_out : (g + 1) * group_out]], attrs)
        for g in range(groups)
    ]
    return fnp.concatenate(outs, axis=1)


# conv2d's arguments after x and w, in PyTorch's order, and their defaults.
_CONV2D_ARGUMENTS = {"b": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1}


def conv2d(x, w, *args, **kwargs):
    """2-D convolution of NCHW `x` with OIHW `w` (plus bias `b` of shape (O,)). With `groups`, the
    channels split into that many independent groups: `w` is (O, C // groups, kh, kw);
    groups == C is a depthwise convolution.

    The arguments after `w` come in PyTorch's order, `conv2d(x, w, b=None, stride=1, padding=0,
    dilation=1, groups=1)` (`bias=` too), or in the order of the public API (DESIGN.md),
    `conv2d(x, w, stride, padding)`, when the third argument is a stride (an int or a pair of ints,
    where a bias is an array): `nn.conv2d(x, w, 2, 1)` has stride 2 and padding 1."""
    names = list(_CONV2D_ARGUMENTS)
    if args and arguments.ints(args[0], lengths=(1, 2)):  # a stride: the public API's order, no bias
        names = names[1:]
    bound = arguments.bind("conv2d", "x and w", args, kwargs, names, _CONV2D_ARGUMENTS, {"bias": "b"})
    b, stride, padding, dilation, groups = bound.values()
    x, w = _float_operands(x, w, "conv2d")
    dilation, stride = _pair(dilation, "dilation"), _pair(stride, "stride")
    if fnp.ndim(x) != 4 or fnp.ndim(w) != 4:
        raise FlowjitTypeError(
            f"{user_location()}: conv2d expects NCHW input and OIHW weights; found shapes {fnp.shape(x)} and "
            f"{fnp.shape(w)}"
        )
    pads = _conv_padding(padding, fnp.shape(x)[2:], fnp.shape(w)[2:], stride, dilation)
    attrs = {"stride": stride, "padding": pads, "dilation": dilation}
    if groups == 1:
        out = bind("conv2d", [x, w], attrs)
    else:
        _check_groups(x, w, groups, "conv2d", "OIHW")
        depthwise = fnp.shape(w)[1] == 1
        out = _depthwise_conv(x, w, stride, pads, dilation) if depthwise else _grouped_conv(x, w, attrs, groups)
    if b is not None:
        out = fnp.add(out, fnp.reshape(_bias(b, fnp.shape(w)[0]), (1, -1, 1, 1)))
    return out


def _bias(b, channels: int):
    """`b` as conv2d's bias: an array of shape (O,) (a stride or padding given in its place, or a
    bias of another length, is an error naming what was found)."""
    if isinstance(b, str) or not (hasattr(b, "shape") or isinstance(b, (list, tuple, float))):
        raise FlowjitTypeError(
            f"{user_location()}: conv2d's third argument is the stride (an int or a pair of ints) or the bias "
            f"(an array of shape ({channels},)); found {b!r}"
        )
    b = fnp.asarray(b)
    if fnp.shape(b) != (channels,):
        raise FlowjitValueError(
            f"{user_location()}: conv2d's bias must have one value per output channel, shape ({channels},); "
            f"found shape {fnp.shape(b)}"
        )
    return b


def conv1d(x, w, b=None, stride: int = 1, padding=0, dilation: int = 1, groups: int = 1):
    """1-D convolution of NCL `x` with OIL `w` (plus bias of shape (O,)). `padding` is 'SAME', 'VALID',
    an int or a (left, right) pair."""
    x, w = fnp.asarray(x), fnp.asarray(w)
    if fnp.ndim(x) != 3 or fnp.ndim(w) != 3:
        raise FlowjitTypeError(
            f"{user_location()}: conv1d expects NCL input and OIL weights; found shapes {fnp.shape(x)} and "
            f"{fnp.shape(w)}"
        )
    if isinstance(padding, int):
        padding = ((0, 0), (padding, padding))
    elif not isinstance(padding, str):
        padding = ((0, 0), _pair(padding, "padding"))
    out = conv2d(fnp.expand_dims(x, 2), fnp.expand_dims(w, 2), b, (1, stride), padding, (1, dilation), groups=groups)
    return fnp.squeeze(out, axis=2)


def conv_transpose2d(x, w, b=None, stride=1, padding=0, output_padding=0, dilation=1, groups: int = 1):
    """The transpose (gradient) of conv2d, as PyTorch's `F.conv_transpose2d`: NCHW `x`, weights of
    shape (C, O // groups, kh, kw); each output dimension is
    (size - 1) * stride - 2 * padding + dilation * (k - 1) + output_padding + 1."""
    x, w = _float_operands(x, w, "conv_transpose2d")
    if fnp.ndim(x) != 4 or fnp.ndim(w) != 4 or fnp.shape(x)[1] != fnp.shape(w)[0] or fnp.shape(w)[0] % groups:
        raise FlowjitTypeError(
            f"{user_location()}: conv_transpose2d expects NCHW input and (C, O // groups, kh, kw) weights with "
            f"C = the input's channels, divisible by groups={groups}; found shapes {fnp.shape(x)} and {fnp.shape(w)}"
        )
    stride, dilation = _pair(stride, "stride"), _pair(dilation, "dilation")
    padding, output_padding = _pair(padding, "padding"), _pair(output_padding, "output_padding")
    if any(op >= max(s, d) or op < 0 for op, s, d in zip(output_padding, stride, dilation)):
        raise FlowjitValueError(
            f"{user_location()}: conv_transpose2d: output_padding {output_padding} must be below stride {stride} or "
            f"dilation {dilation}"
        )
    in_channels, group_out, kh, kw = fnp.shape(w)
    if groups == 1 and dilation == (1, 1) and max(stride) > 1:
        # The adjoint of conv2d(., w, stride, padding) whose input is this output's size: one
        # stride-1 conv per phase, never multiplying the zeros a stride-dilated input would hold.
        from flowjit.numpy import vjp_rules

        if vjp_rules.STRIDED_INPUT_GRADIENT_BY_PHASES:
            size = tuple(
                (n - 1) * s - 2 * p + (k - 1) + op + 1
                for n, s, p, k, op in zip(fnp.shape(x)[2:], stride, padding, (kh, kw), output_padding)
            )
            out = vjp_rules.conv2d_input_grad_by_phases(x, w, size, stride, tuple((p, p) for p in padding))
            return out if b is None else fnp.add(out, fnp.reshape(b, (1, -1, 1, 1)))
    # (C, O/g, kh, kw) -> (O, C/g, kh, kw), spatially flipped: the forward conv's adjoint.
    w = fnp.reshape(w, (groups, in_channels // groups, group_out, kh, kw))
    w = fnp.reshape(fnp.transpose(w, (0, 2, 1, 3, 4)), (groups * group_out, in_channels // groups, kh, kw))
    w = fnp.flip(w, axis=(2, 3))
    reach = (dilation[0] * (kh - 1), dilation[1] * (kw - 1))
    low = [r - p for r, p in zip(reach, padding)]
    high = [r - p + op for r, p, op in zip(reach, padding, output_padding)]
    zero = fnp.zeros((), fnp.result_type(x))
    dilated = bind(
        "pad",
        [x, zero],
        {
            "low": (0, 0, *(max(v, 0) for v in low)),
            "high": (0, 0, *(max(v, 0) for v in high)),
            "interior": (0, 0, stride[0] - 1, stride[1] - 1),
        },
    )
    # Padding beyond the kernel's reach crops the result instead.
    height, width = fnp.shape(dilated)[2:]
    dilated = dilated[:, :, max(-low[0], 0) : height - max(-high[0], 0), max(-low[1], 0) : width - max(-high[1], 0)]
    return conv2d(dilated, w, b, stride=1, padding=0, dilation=dilation, groups=groups)


# --- pooling ----------------------------------------------------------------------------------------------


def _pool(kind, x, window, stride, padding):
    x = fnp.asarray(x)
    if fnp.ndim(x) != 4:
        raise FlowjitTypeError(f"{user_location()}: {kind} pooling expects NCHW input; found shape {fnp.shape(x)}")
    window = _pair(window, "window")
    stride = window if stride is None else _pair(stride, "stride")
    pad = _conv_padding(padding, fnp.shape(x)[2:], window, stride, (1, 1))
    return bind(
        "reduce_window",
        [x],
        {"kind": kind, "window": (1, 1, *window), "strides": (1, 1, *stride), "padding": ((0, 0), (0, 0), *pad)},
    )


def max_pool2d(x, window=2, stride=None, padding=0):
    """Max over `window` (default stride = window) of NCHW `x`."""
    return _pool("max", x, window, stride, padding)


def avg_pool2d(x, window=2, stride=None, padding=0):
    """Average over `window` of NCHW `x` (padding counts toward the divisor)."""
    return _pool("avg", x, window, stride, padding)


def _adaptive_bins(n: int, out: int, dtype):
    """The (out, n) matrix averaging PyTorch's adaptive bins: bin i covers
    [floor(i * n / out), ceil((i + 1) * n / out)), which overlap when out does not divide n."""
    weights = np.zeros((out, n))
    for i in range(out):
        start, stop = i * n // out, -(-(i + 1) * n // out)
        weights[i, start:stop] = 1.0 / (stop - start)
    return weights.astype(dtype.np_dtype)


def adaptive_avg_pool2d(x, output_size):
    """Average NCHW `x` into an (oh, ow) grid of bins as PyTorch does (bins overlap when the size does
    not divide evenly); `output_size` is an int or a pair."""
    x = fnp.asarray(x)
    if fnp.ndim(x) != 4:
        raise FlowjitTypeError(f"{user_location()}: adaptive_avg_pool2d expects NCHW input; found {fnp.shape(x)}")
    oh, ow = _pair(output_size, "output_size")
    if oh < 1 or ow < 1:
        raise FlowjitValueError(f"{user_location()}: adaptive_avg_pool2d: output_size must be positive; found {oh, ow}")
    n, c, h, w = fnp.shape(x)
    if h % oh == 0 and w % ow == 0:
        return fnp.mean(fnp.reshape(x, (n, c, oh, h // oh, ow, w // ow)), axis=(3, 5))
    # Uneven bins: two small contractions with the bin-averaging matrices.
    dtype = fnp.result_type(x)
    rows = fnp.matmul(_adaptive_bins(h, oh, dtype), x)
    return fnp.matmul(rows, fnp.transpose(_adaptive_bins(w, ow, dtype)))


def global_avg_pool2d(x, keepdims: bool = False):
    """Mean over the spatial axes of NCHW `x`: (N, C), or (N, C, 1, 1) with keepdims."""
    x = fnp.asarray(x)
    if fnp.ndim(x) != 4:
        raise FlowjitTypeError(f"{user_location()}: global_avg_pool2d expects NCHW input; found {fnp.shape(x)}")
    return fnp.mean(x, axis=(2, 3), keepdims=keepdims)
