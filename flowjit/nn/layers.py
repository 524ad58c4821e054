"""Embeddings, dropout, linear layers and attention."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from flowjit import numpy as fnp
from flowjit import random
from flowjit.errors import FlowjitTypeError, FlowjitValueError
from flowjit.ir.location import user_location
from flowjit.nn.activations import softmax


def embedding(table, ids):
    """Rows of `table` [vocab, dim] for integer `ids` (any shape) -> [*ids.shape, dim].

    PyTorch's `F.embedding(ids, table)` order is accepted too: a float `ids` with an integer `table`
    can only mean the arguments were swapped."""
    table, ids = fnp.asarray(table), fnp.asarray(ids)
    if np.issubdtype(table.dtype, np.integer) and np.issubdtype(ids.dtype, np.floating):
        table, ids = ids, table
    return fnp.take(table, ids, axis=0)


def dropout(key, x, rate: float, deterministic: bool = False):
    """Zero each element with probability `rate` and scale survivors by 1/(1-rate) (inverted dropout).
    `deterministic=True` (evaluation) returns x unchanged."""
    if deterministic or rate == 0.0:
        return x
    if not 0.0 <= rate < 1.0:
        raise FlowjitValueError(f"{user_location()}: dropout rate must be in [0, 1); found {rate}")
    keep = random.bernoulli(key, 1.0 - rate, fnp.shape(x))
    return fnp.where(keep, fnp.divide(x, 1.0 - rate), 0.0)


def linear(x, w, b=None):
    """x @ w + b."""
    out = fnp.matmul(x, w)
    return out if b is None else fnp.add(out, b)


def scaled_dot_product_attention(query, key, value, attn_mask=None, is_causal: bool = False, scale=None):
    """softmax(query @ key^T * scale + mask) @ value over the last two axes, as PyTorch's
    `F.scaled_dot_product_attention`: query [..., L, E], key [..., S, E], value [..., S, Ev] -> [..., L, Ev].

    scale: 1 / sqrt(E) by default. attn_mask (broadcast to [..., L, S]): booleans, True where a query
    may attend, or floats added to the scores. is_causal: query i attends to keys 0..i (top-left
    aligned). A query that may attend to nothing gets uniform weights (not nan)."""
    query, key, value = fnp.asarray(query), fnp.asarray(key), fnp.asarray(value)
    if fnp.ndim(query) < 2 or fnp.shape(query)[-1] != fnp.shape(key)[-1] or fnp.shape(key)[-2] != fnp.shape(value)[-2]:
        raise FlowjitTypeError(
            f"{user_location()}: scaled_dot_product_attention expects query [..., L, E], key [..., S, E] and value "
            f"[..., S, Ev]; found {fnp.shape(query)}, {fnp.shape(key)} and {fnp.shape(value)}"
        )
    if scale is None:
        scale = 1.0 / math.sqrt(fnp.shape(query)[-1])
    scores = fnp.multiply(fnp.matmul(query, fnp.swapaxes(key, -1, -2)), scale)
    length, source = fnp.shape(scores)[-2:]
    # The most negative finite value: a fully masked row then softmaxes to uniform instead of nan.
    lowest = float(ml_dtypes.finfo(fnp.result_type(scores).np_dtype).min)
    if is_causal:
        allowed = fnp.greater_equal(fnp.iota((length, source), 0), fnp.iota((length, source), 1))
        scores = fnp.where(allowed, scores, lowest)
    if attn_mask is not None:
        attn_mask = fnp.asarray(attn_mask)
        if np.issubdtype(attn_mask.dtype, np.bool_):
            scores = fnp.where(attn_mask, scores, lowest)
        else:
            scores = fnp.add(scores, attn_mask)
    return fnp.matmul(softmax(scores, axis=-1), value)


def _split_heads(x, num_heads: int):
    """[..., T, D] -> [..., heads, T, D // heads]."""
    *lead, length, width = fnp.shape(x)
    return fnp.swapaxes(fnp.reshape(x, (*lead, length, num_heads, width // num_heads)), -2, -3)


def multi_head_attention(query, key, value, params, num_heads: int, attn_mask=None, is_causal: bool = False):
    """Multi-head attention on [..., T, D] inputs with `params` {"wq", "wk", "wv", "wo"} (each [D, D],
    applied as x @ w) and optional biases {"bq", "bk", "bv", "bo"}: project, split D into `num_heads`
    heads, attend per head (scaled_dot_product_attention, mask broadcast over heads), merge, project."""
    width = fnp.shape(query)[-1]
    if width % num_heads:
        raise FlowjitValueError(
            f"{user_location()}: multi_head_attention: model width {width} is not divisible by {num_heads} heads"
        )
    q, k, v = (
        _split_heads(linear(x, params[f"w{n}"], params.get(f"b{n}")), num_heads)
        for x, n in ((query, "q"), (key, "k"), (value, "v"))
    )
    attended = scaled_dot_product_attention(q, k, v, attn_mask, is_causal)
    *lead, heads, length, head_width = fnp.shape(attended)
    merged = fnp.reshape(fnp.swapaxes(attended, -2, -3), (*lead, length, heads * head_width))
    return linear(merged, params["wo"], params.get("bo"))
