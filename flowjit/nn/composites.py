"""The composites of `flowjit.nn` (`flowjit.ir.composites`): the graphs of softmax, log-softmax and
the norms on the last axis, as this library traces them, registered so that backends can recognize
fused regions that are exactly one of them (the CPU row library runs them as precompiled routines).
The norms are traced with `EPS_MARKER` as eps, which marks where a matched region's eps is."""

from __future__ import annotations

from flowjit import numpy as fnp
from flowjit.frontend.jit import optimized_graph
from flowjit.frontend.signature import ShapeDtype
from flowjit.ir.composites import EPS_MARKER, register_composite
from flowjit.nn.activations import log_softmax, softmax
from flowjit.nn.normalization import layer_norm, rms_norm


def _layer_norm_divided(x):
    centered = fnp.subtract(x, fnp.mean(x, axis=-1, keepdims=True))
    var = fnp.mean(fnp.multiply(centered, centered), axis=-1, keepdims=True)
    return fnp.divide(centered, fnp.sqrt(fnp.add(var, EPS_MARKER)))


def _softmax_divided(x):
    e = fnp.exp(fnp.subtract(x, fnp.max(x, axis=-1, keepdims=True)))
    return fnp.divide(e, fnp.sum(e, axis=-1, keepdims=True))


# name -> the function whose graph it is (written as users write it: `e / e.sum(...)` divides
# where `nn.softmax` multiplies by a reciprocal)
FUNCTIONS = {
    "softmax": lambda x: softmax(x, axis=-1),
    "softmax_divided": _softmax_divided,
    "log_softmax": lambda x: log_softmax(x, axis=-1),
    "layer_norm": lambda x: layer_norm(x, eps=EPS_MARKER),
    "layer_norm_affine": lambda x, gamma, beta: layer_norm(x, gamma, beta, eps=EPS_MARKER),
    "layer_norm_divided": _layer_norm_divided,
    "layer_norm_divided_affine": lambda x, gamma, beta: fnp.add(fnp.multiply(_layer_norm_divided(x), gamma), beta),
    "rms_norm": lambda x: rms_norm(x, eps=EPS_MARKER),
    "rms_norm_scaled": lambda x, gamma: rms_norm(x, gamma, eps=EPS_MARKER),
}


def _builder(fn):
    def build(types):
        return optimized_graph(fn, *[ShapeDtype(t.shape, t.dtype.np_dtype) for t in types])

    return build


for _name, _fn in FUNCTIONS.items():
    register_composite(_name, _fn.__code__.co_argcount, _builder(_fn))
