"""Losses with PyTorch's definitions and `reduction="mean" | "sum" | "none"`, plus one_hot and
accuracy. Class scores are on the last axis (as in JAX/optax): logits [..., classes], labels [...].

Logarithms that may see 0 take it through a double `where`: log(where(p > 0, p, 1)), so both the
value (clamped, as PyTorch does at -100) and the gradient stay finite.
"""

from __future__ import annotations

import numpy as np

from flowjit import numpy as fnp
from flowjit.errors import FlowjitTypeError, FlowjitValueError
from flowjit.ir.location import user_location
from flowjit.nn.activations import log_sigmoid, log_softmax


def _check_reduction(reduction, what: str) -> None:
    if reduction not in ("mean", "sum", "none"):
        raise FlowjitValueError(
            f"{user_location()}: {what}: reduction must be 'mean', 'sum' or 'none'; found {reduction!r}"
        )


def _reduce(losses, reduction: str):
    if reduction == "none":
        return losses
    return fnp.sum(losses) if reduction == "sum" else fnp.mean(losses)


def _check_same_shape(pred, target, what: str) -> None:
    """Equal shapes (or a scalar target): a (N, 1) prediction against a (N,) target would broadcast to
    (N, N) and silently compute the wrong loss."""
    pred_shape, target_shape = tuple(fnp.shape(pred)), tuple(fnp.shape(target))
    if pred_shape != target_shape and target_shape != ():
        raise FlowjitTypeError(
            f"{user_location()}: {what}: input of shape {pred_shape} and target of shape {target_shape} differ; "
            "reshape one of them (losses do not broadcast)"
        )


def _safe_log(p):
    """log(p) for p > 0 and -100 for p <= 0, with a finite gradient everywhere."""
    positive = fnp.greater(p, 0)
    return fnp.maximum(fnp.where(positive, fnp.log(fnp.where(positive, p, 1.0)), -100.0), -100.0)


def one_hot(labels, num_classes: int, dtype="float32"):
    """labels[..., None] == arange(num_classes), as `dtype`. Compared in int32 (half the vector
    work of int64 per class: in int64, cross-entropy's pick over 1000 classes costs as much as its
    log-softmax), each label outside [0, num_classes) first made -1, which matches no class, as it
    would in int64."""
    labels = fnp.asarray(labels)
    index = "i32" if num_classes < 2**31 else "i64"
    labels = fnp.astype(labels, "i64")
    if index == "i32":
        inside = fnp.logical_and(fnp.greater_equal(labels, 0), fnp.less(labels, num_classes))
        labels = fnp.astype(fnp.where(inside, labels, -1), "i32")
    classes = fnp.iota(tuple(fnp.shape(labels)) + (num_classes,), fnp.ndim(labels), index)
    return fnp.astype(fnp.equal(fnp.expand_dims(labels, -1), classes), dtype)


def _picked_nll(log_probs, labels, label_smoothing, ignore_index, reduction):
    """-log_probs[..., label] (mixed with the uniform target when smoothing), averaged over the labels
    that are not `ignore_index`."""
    picked = fnp.sum(fnp.where(one_hot(labels, fnp.shape(log_probs)[-1], "bool"), log_probs, 0.0), axis=-1)
    losses = fnp.negative(picked)
    if label_smoothing:
        uniform = fnp.negative(fnp.mean(log_probs, axis=-1))
        losses = fnp.add(fnp.multiply(losses, 1.0 - label_smoothing), fnp.multiply(uniform, label_smoothing))
    if ignore_index is None:
        return _reduce(losses, reduction)
    valid = fnp.not_equal(labels, ignore_index)
    losses = fnp.where(valid, losses, 0.0)
    if reduction != "mean":
        return _reduce(losses, reduction)
    return fnp.divide(fnp.sum(losses), fnp.astype(fnp.sum(valid), losses.dtype))


def _check_labels(scores, labels, what: str) -> None:
    if not np.issubdtype(labels.dtype, np.integer):
        raise FlowjitTypeError(
            f"{user_location()}: {what} expects integer class labels of shape {fnp.shape(scores)[:-1]} or class "
            f"probabilities of shape {fnp.shape(scores)}; found {labels.dtype} of shape {fnp.shape(labels)}"
        )
    if tuple(fnp.shape(labels)) != tuple(fnp.shape(scores))[:-1]:
        raise FlowjitTypeError(
            f"{user_location()}: {what}: labels of shape {fnp.shape(labels)} do not match scores of shape "
            f"{fnp.shape(scores)} (expected labels of shape {fnp.shape(scores)[:-1]}; classes are the last axis)"
        )


def cross_entropy(
    logits, labels, reduction: str = "mean", label_smoothing: float = 0.0, ignore_index: int | None = -100
):
    """Softmax cross-entropy of `logits` [..., classes] against integer class `labels` [...] or class
    probabilities [..., classes] (soft targets), as PyTorch's `F.cross_entropy` with the classes last.

    label_smoothing: mix the target with the uniform distribution by this weight. ignore_index: integer
    labels equal to it contribute 0 and are left out of the mean (PyTorch's -100 by default; None keeps
    every label). reduction: 'mean' (default), 'sum' or 'none'.
    """
    _check_reduction(reduction, "cross_entropy")
    if not 0.0 <= label_smoothing <= 1.0:
        raise FlowjitValueError(f"{user_location()}: label_smoothing must be in [0, 1]; found {label_smoothing}")
    logits, labels = fnp.asarray(logits), fnp.asarray(labels)
    log_probs = log_softmax(logits, axis=-1)
    if np.issubdtype(labels.dtype, np.floating) and tuple(fnp.shape(labels)) == tuple(fnp.shape(logits)):
        classes = fnp.shape(logits)[-1]
        targets = fnp.add(fnp.multiply(labels, 1.0 - label_smoothing), label_smoothing / classes)
        # Select, not multiply: a -inf logit with a zero target would give -inf * 0 = nan.
        terms = fnp.where(fnp.equal(targets, 0), 0.0, fnp.multiply(targets, log_probs))
        return _reduce(fnp.negative(fnp.sum(terms, axis=-1)), reduction)
    _check_labels(logits, labels, "cross_entropy")
    return _picked_nll(log_probs, labels, label_smoothing, ignore_index, reduction)


def nll_loss(log_probs, labels, reduction: str = "mean", ignore_index: int | None = -100):
    """Negative log-likelihood -log_probs[..., label] of log-probabilities [..., classes] (e.g. from
    log_softmax) for integer `labels` [...]; `ignore_index` and `reduction` as in cross_entropy."""
    _check_reduction(reduction, "nll_loss")
    log_probs, labels = fnp.asarray(log_probs), fnp.asarray(labels)
    _check_labels(log_probs, labels, "nll_loss")
    return _picked_nll(log_probs, labels, 0.0, ignore_index, reduction)


def binary_cross_entropy(probs, targets, reduction: str = "mean"):
    """-(t * log(p) + (1 - t) * log(1 - p)) for probabilities `probs`, each log clamped at -100 as in
    PyTorch. Prefer binary_cross_entropy_with_logits, which is exact for saturated sigmoids."""
    _check_reduction(reduction, "binary_cross_entropy")
    probs, targets = fnp.asarray(probs), fnp.asarray(targets)
    _check_same_shape(probs, targets, "binary_cross_entropy")
    positive = fnp.multiply(targets, _safe_log(probs))
    negative = fnp.multiply(fnp.subtract(1.0, targets), _safe_log(fnp.subtract(1.0, probs)))
    return _reduce(fnp.negative(fnp.add(positive, negative)), reduction)


def binary_cross_entropy_with_logits(logits, targets, reduction: str = "mean", pos_weight=None):
    """binary_cross_entropy(sigmoid(logits), targets) computed from the logits with log_sigmoid, so
    it is finite and exact for any logit. `pos_weight` scales the positive term (per class)."""
    _check_reduction(reduction, "binary_cross_entropy_with_logits")
    logits, targets = fnp.asarray(logits), fnp.asarray(targets)
    _check_same_shape(logits, targets, "binary_cross_entropy_with_logits")
    positive = fnp.multiply(targets, log_sigmoid(logits))
    if pos_weight is not None:
        positive = fnp.multiply(positive, pos_weight)
    negative = fnp.multiply(fnp.subtract(1.0, targets), log_sigmoid(fnp.negative(logits)))
    return _reduce(fnp.negative(fnp.add(positive, negative)), reduction)


def mse_loss(pred, target, reduction: str = "mean"):
    """(pred - target)^2."""
    _check_reduction(reduction, "mse_loss")
    _check_same_shape(pred, target, "mse_loss")
    diff = fnp.subtract(pred, target)
    return _reduce(fnp.multiply(diff, diff), reduction)


def l1_loss(pred, target, reduction: str = "mean"):
    """|pred - target|."""
    _check_reduction(reduction, "l1_loss")
    _check_same_shape(pred, target, "l1_loss")
    return _reduce(fnp.abs(fnp.subtract(pred, target)), reduction)


def huber_loss(pred, target, delta: float = 1.0, reduction: str = "mean"):
    """0.5 d^2 for |d| < delta, delta * (|d| - delta / 2) beyond (d = pred - target), as PyTorch's."""
    _check_reduction(reduction, "huber_loss")
    _check_same_shape(pred, target, "huber_loss")
    diff = fnp.abs(fnp.subtract(pred, target))
    quadratic = fnp.multiply(0.5, fnp.multiply(diff, diff))
    linear = fnp.multiply(delta, fnp.subtract(diff, 0.5 * delta))
    return _reduce(fnp.where(fnp.less(diff, delta), quadratic, linear), reduction)


def smooth_l1_loss(pred, target, beta: float = 1.0, reduction: str = "mean"):
    """huber_loss / beta: 0.5 d^2 / beta for |d| < beta, |d| - beta / 2 beyond (l1_loss for beta=0)."""
    _check_reduction(reduction, "smooth_l1_loss")
    _check_same_shape(pred, target, "smooth_l1_loss")
    if beta == 0.0:
        return l1_loss(pred, target, reduction)
    return fnp.divide(huber_loss(pred, target, beta, reduction), beta)


def kl_div(log_pred, target, reduction: str = "mean", log_target: bool = False):
    """Pointwise KL divergence target * (log(target) - log_pred), with 0 where target is 0, for
    log-probabilities `log_pred`; PyTorch's `F.kl_div` argument order. `log_target=True` takes the
    target as log-probabilities too. reduction also accepts 'batchmean' (sum / batch size, the true KL
    per sample; 'mean' divides by the number of elements, as PyTorch does)."""
    if reduction != "batchmean":
        _check_reduction(reduction, "kl_div")
    log_pred, target = fnp.asarray(log_pred), fnp.asarray(target)
    _check_same_shape(log_pred, target, "kl_div")
    if log_target:
        terms = fnp.multiply(fnp.exp(target), fnp.subtract(target, log_pred))
    else:
        positive = fnp.greater(target, 0)
        log_target_values = fnp.log(fnp.where(positive, target, 1.0))
        terms = fnp.where(positive, fnp.multiply(target, fnp.subtract(log_target_values, log_pred)), 0.0)
    if reduction == "batchmean":
        return fnp.divide(fnp.sum(terms), fnp.shape(terms)[0] if fnp.ndim(terms) else 1)
    return _reduce(terms, reduction)


def accuracy(logits, labels):
    """Fraction of rows whose argmax equals the label."""
    return fnp.mean(fnp.astype(fnp.equal(fnp.argmax(logits, axis=-1), labels), "float32"))
