"""Normalization layers as pure functions: layer, RMS, batch, group and instance normalization.

Batch normalization has two forms, as in Flax and `torch.func`: `batch_norm` normalizes with given
statistics (inference), `batch_norm_train` normalizes with the batch's own statistics and returns the
updated running statistics next to the output, so a jitted train step threads them like parameters.
"""

from __future__ import annotations

from flowjit import numpy as fnp
from flowjit.errors import FlowjitValueError
from flowjit.ir.location import user_location
from flowjit.nn import arguments


def _affine(out, gamma, beta, shape=None):
    """out * gamma + beta, each reshaped to `shape` (for a channel axis) when given."""
    if gamma is not None:
        out = fnp.multiply(out, gamma if shape is None else fnp.reshape(gamma, shape))
    if beta is not None:
        out = fnp.add(out, beta if shape is None else fnp.reshape(beta, shape))
    return out


def _norm_arguments(what: str, x, args: tuple, kwargs: dict, ours: dict, torch: tuple) -> dict:
    """The arguments of `what` after `x` in flowjit's order (`ours`: names and defaults, `gamma`
    first), or in PyTorch's when the first is a shape (`torch`: `normalized_shape`, then names of
    `ours`; `weight` for `gamma` and `bias` for `beta` as keywords in either order): then `axis` is
    the last len(normalized_shape) axes, which must have that shape."""
    torch_order = (args and arguments.ints(args[0])) or "normalized_shape" in kwargs
    names = list(torch) if torch_order else list(ours)
    defaults = dict(ours) | {"normalized_shape": None}
    values = arguments.bind(what, "x", args, kwargs, names, defaults, {"weight": "gamma", "bias": "beta"})
    shape = values.pop("normalized_shape")
    if shape is not None:
        shape = (int(shape),) if arguments.whole(shape) else tuple(int(d) for d in shape)
        axis_given = "axis" in kwargs  # in PyTorch's order only a keyword can give it
        if axis_given or tuple(fnp.shape(x)[len(fnp.shape(x)) - len(shape) :]) != shape:
            found = "an axis too" if axis_given else f"an input of shape {fnp.shape(x)}"
            raise FlowjitValueError(
                f"{user_location()}: {what} with normalized_shape={shape} normalizes the last {len(shape)} axes, "
                f"which must have that shape; found {found}"
            )
        values["axis"] = tuple(range(-len(shape), 0))
    return values


def layer_norm(x, *args, **kwargs):
    """(x - mean) / sqrt(var + eps) over `axis`, then scaled by `gamma` and shifted by `beta`:
    `layer_norm(x, gamma=None, beta=None, eps=1e-5, axis=-1)`, or PyTorch's
    `layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5)` (over the last axes, which
    must have that shape) when the second argument is a shape (an int or a tuple of ints)."""
    x = fnp.asarray(x)
    given = _norm_arguments(
        "layer_norm",
        x,
        args,
        kwargs,
        {"gamma": None, "beta": None, "eps": 1e-5, "axis": -1},
        ("normalized_shape", "gamma", "beta", "eps"),
    )
    gamma, beta, eps, axis = given["gamma"], given["beta"], given["eps"], given["axis"]
    mean = fnp.mean(x, axis=axis, keepdims=True)
    centered = fnp.subtract(x, mean)
    var = fnp.mean(fnp.multiply(centered, centered), axis=axis, keepdims=True)
    return _affine(fnp.multiply(centered, fnp.rsqrt(fnp.add(var, eps))), gamma, beta)


def rms_norm(x, *args, **kwargs):
    """x / sqrt(mean(x^2) + eps) over `axis`, scaled by `gamma` (no centering; as in T5 and LLaMA):
    `rms_norm(x, gamma=None, eps=1e-6, axis=-1)`, or PyTorch's `rms_norm(x, normalized_shape,
    weight=None, eps=1e-6)` when the second argument is a shape."""
    x = fnp.asarray(x)
    given = _norm_arguments(
        "rms_norm", x, args, kwargs, {"gamma": None, "eps": 1e-6, "axis": -1}, ("normalized_shape", "gamma", "eps")
    )
    gamma, eps, axis = given["gamma"], given["eps"], given["axis"]
    mean_square = fnp.mean(fnp.multiply(x, x), axis=axis, keepdims=True)
    return _affine(fnp.multiply(x, fnp.rsqrt(fnp.add(mean_square, eps))), gamma, None)


def _channel_shape(x, axis: int, what: str):
    """The broadcast shape of per-channel vectors for channel `axis` of `x`, and the other axes."""
    rank = fnp.ndim(x)
    if rank < 2 or not -rank <= axis < rank:
        raise FlowjitValueError(
            f"{user_location()}: {what} expects an input with a batch and a channel axis {axis}; found shape "
            f"{fnp.shape(x)}"
        )
    axis %= rank
    shape = [1] * rank
    shape[axis] = fnp.shape(x)[axis]
    return tuple(shape), tuple(a for a in range(rank) if a != axis)


def batch_norm(x, mean, var, gamma=None, beta=None, eps: float = 1e-5, axis: int = 1):
    """Inference batch normalization: (x - mean) / sqrt(var + eps) * gamma + beta, with per-channel
    `mean`, `var`, `gamma`, `beta` of shape (C,) for channel `axis` (1: NCHW or NC, as in PyTorch)."""
    x = fnp.asarray(x)
    shape, _ = _channel_shape(x, axis, "batch_norm")
    scale = fnp.rsqrt(fnp.add(fnp.reshape(var, shape), eps))
    return _affine(fnp.multiply(fnp.subtract(x, fnp.reshape(mean, shape)), scale), gamma, beta, shape)


def batch_norm_train(
    x, running_mean, running_var, gamma=None, beta=None, momentum: float = 0.1, eps: float = 1e-5, axis: int = 1
):
    """Training batch normalization: normalize with this batch's mean and (biased) variance over every
    axis but the channel `axis`, and return `(out, new_running_mean, new_running_var)` with PyTorch's
    update: running = (1 - momentum) * running + momentum * batch_stat, the variance unbiased."""
    x = fnp.asarray(x)
    shape, reduce_axes = _channel_shape(x, axis, "batch_norm_train")
    count = fnp.size(x) // shape[axis % fnp.ndim(x)]
    if count < 2:
        raise FlowjitValueError(
            f"{user_location()}: batch_norm_train needs more than one value per channel; found shape {fnp.shape(x)}"
        )
    mean = fnp.mean(x, axis=reduce_axes, keepdims=True)
    centered = fnp.subtract(x, mean)
    var = fnp.mean(fnp.multiply(centered, centered), axis=reduce_axes, keepdims=True)
    out = _affine(fnp.multiply(centered, fnp.rsqrt(fnp.add(var, eps))), gamma, beta, shape)
    batch_mean = fnp.reshape(mean, (-1,))
    unbiased_var = fnp.multiply(fnp.reshape(var, (-1,)), count / (count - 1))
    new_mean = fnp.add(fnp.multiply(running_mean, 1.0 - momentum), fnp.multiply(batch_mean, momentum))
    new_var = fnp.add(fnp.multiply(running_var, 1.0 - momentum), fnp.multiply(unbiased_var, momentum))
    return out, new_mean, new_var


def group_norm(x, num_groups: int, gamma=None, beta=None, eps: float = 1e-5):
    """Normalize NC... `x` over each group of C // num_groups channels and all spatial positions,
    then apply per-channel `gamma` and `beta` of shape (C,) (PyTorch's `F.group_norm`)."""
    x = fnp.asarray(x)
    shape = tuple(fnp.shape(x))
    if len(shape) < 2 or shape[1] % num_groups:
        raise FlowjitValueError(
            f"{user_location()}: group_norm needs NC... input whose channels divide into {num_groups} groups; "
            f"found shape {shape}"
        )
    grouped = fnp.reshape(x, (shape[0], num_groups, -1))
    normalized = fnp.reshape(layer_norm(grouped, eps=eps, axis=-1), shape)
    channel = (1, shape[1]) + (1,) * (len(shape) - 2)
    return _affine(normalized, gamma, beta, channel)


def instance_norm(x, gamma=None, beta=None, eps: float = 1e-5):
    """Normalize each channel of each sample of NC... `x` over its spatial positions (group_norm with
    one channel per group)."""
    x = fnp.asarray(x)
    channels = fnp.shape(x)[1] if fnp.ndim(x) >= 2 else 0
    return group_norm(x, max(channels, 1), gamma, beta, eps)
