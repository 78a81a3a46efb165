"""Rules for reductions (sum, mean, amax), softmax and log-softmax with their backwards, and nll_loss.

Formulas are ATen's: softmax subtracts the max before exponentiating, the
backwards are written in terms of the forward output, and nll_loss's mean
divides by the number of targets that are not `ignore_index`.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from tv_ray.errors import GraphError, ShapeError
from tv_ray.ir.ops import Op
from tv_ray.semantics.shapes import fmt, norm_dim, numel, require_rank, same_shape
from tv_ray.semantics.table import rule

# -- sum, mean, amax --------------------------------------------------------------
def _reduced_dims(dims, rank: int, what: str) -> tuple[int, ...]:
    # ATen reduces over every dim when the list is empty.
    if not dims:
        return tuple(range(rank))
    out = tuple(sorted({norm_dim(d, rank, what) for d in dims}))
    if len(out) != len(dims):
        raise ShapeError(f"{what}: dims {list(dims)} name a dim twice")
    return out


def _reduce_shape(op: Op):
    def shape(shapes, attrs, ctx):
        dims = _reduced_dims(attrs["dims"], len(shapes[0]), str(op))
        if attrs["keepdim"]:
            return tuple(1 if i in dims else d for i, d in enumerate(shapes[0]))
        return tuple(d for i, d in enumerate(shapes[0]) if i not in dims)
    return shape


# op -> (numpy reduction, result dtype from the input dtype)
REDUCTIONS: dict[Op, tuple[Callable, Callable[[str], str]]] = {
    Op.SUM: (np.sum, lambda d: "float" if d == "float" else "int"),
    Op.MEAN: (np.mean, lambda d: "float"),
    Op.AMAX: (np.amax, lambda d: d),
}


def _register_reduction(op: Op, fn: Callable, result: Callable[[str], str]) -> None:
    def concrete(xs, attrs, ctx):
        dims = _reduced_dims(attrs["dims"], xs[0].ndim, str(op))
        return np.asarray(fn(xs[0], axis=dims, keepdims=attrs["keepdim"]))

    rule(op, shape=_reduce_shape(op), dtype=lambda dtypes, a: result(dtypes[0]), concrete=concrete)


for _op, (_fn, _result) in REDUCTIONS.items():
    _register_reduction(_op, _fn, _result)


# -- softmax family -------------------------------------------------------------------
def _softmax_dim(shape, attrs, what: str) -> int:
    return norm_dim(attrs["dim"], len(shape), what)


def _softmax(x, dim):
    e = np.exp(x - np.amax(x, axis=dim, keepdims=True))
    return e / np.sum(e, axis=dim, keepdims=True)


def _log_softmax(x, dim):
    shifted = x - np.amax(x, axis=dim, keepdims=True)
    return shifted - np.log(np.sum(np.exp(shifted), axis=dim, keepdims=True))


def _softmax_backward(grad, out, dim):
    return out * (grad - np.sum(grad * out, axis=dim, keepdims=True))


def _log_softmax_backward(grad, out, dim):
    return grad - np.exp(out) * np.sum(grad, axis=dim, keepdims=True)


def _float(dtypes, attrs):
    return "float"


def _register_softmax(op: Op, fn: Callable) -> None:
    def shape(shapes, attrs, ctx):
        _softmax_dim(shapes[0], attrs, str(op))
        if len(shapes) == 2 and not same_shape(shapes[0], shapes[1]):
            raise ShapeError(f"{op}: grad {fmt(shapes[0])} and output {fmt(shapes[1])} differ in shape")
        return tuple(shapes[0])

    rule(op, shape=shape, dtype=_float,
         concrete=lambda xs, a, ctx: fn(*[x.astype(np.float64) for x in xs], _softmax_dim(xs[0].shape, a, str(op))))


for _op, _fn in {Op.SOFTMAX: _softmax, Op.LOG_SOFTMAX: _log_softmax,
                 Op.SOFTMAX_BACKWARD: _softmax_backward,
                 Op.LOG_SOFTMAX_BACKWARD: _log_softmax_backward}.items():
    _register_softmax(_op, _fn)


# -- nll_loss --------------------------------------------------------------------------------
REDUCTION_KINDS = ("mean", "sum", "none")


def _check_nll_shapes(logp, target, what: str) -> None:
    require_rank(logp, (1, 2), f"{what} input")
    if not same_shape(target, logp[:-1]):
        raise ShapeError(f"{what}: target {fmt(target)} does not match input {fmt(logp)} "
                         f"(expected {fmt(logp[:-1])})")


def _reduction(attrs, what: str) -> str:
    if attrs["reduction"] not in REDUCTION_KINDS:
        raise GraphError(f"{what}: reduction must be one of {', '.join(REDUCTION_KINDS)}, "
                         f"got {attrs['reduction']!r}")
    return attrs["reduction"]


def _picked(logp, target, ignore_index):
    """Per target: (logp at the target class, whether the target counts), as [N] arrays."""
    logp2, target1 = logp.reshape(-1, logp.shape[-1]), target.reshape(-1)
    counts = target1 != ignore_index
    safe = np.where(counts, target1, 0)
    if np.any((safe < 0) | (safe >= logp2.shape[1])):
        raise ShapeError(f"nll_loss: a target lies outside [0, {logp2.shape[1]}) and is not ignore_index")
    return logp2[np.arange(len(safe)), safe], counts


def _nll_loss_shape(shapes, attrs, ctx):
    _check_nll_shapes(shapes[0], shapes[1], "nll_loss")
    return tuple(shapes[1]) if _reduction(attrs, "nll_loss") == "none" else ()


def _nll_loss(xs, attrs, ctx):
    logp, target = xs
    picked, counts = _picked(logp, target, attrs["ignore_index"])
    losses = np.where(counts, -picked, 0.0)
    reduction = _reduction(attrs, "nll_loss")
    if reduction == "none":
        return losses.reshape(target.shape)
    total = np.sum(losses)
    # ATen's mean is 0/0 = nan when every target is ignored.
    return np.asarray(total / np.sum(counts) if reduction == "mean" else total, dtype=np.float64)


rule(Op.NLL_LOSS, shape=_nll_loss_shape, dtype=_float, concrete=_nll_loss)


def _total_weight_shape(shapes, attrs, ctx):
    require_rank(shapes[0], (0, 1), "nll_loss_total_weight target")
    return ()


# (target) -> the number of targets that are not ignore_index, as a float scalar
rule(Op.NLL_LOSS_TOTAL_WEIGHT, shape=_total_weight_shape, dtype=_float,
     concrete=lambda xs, a, ctx: np.asarray(np.sum(xs[0] != a["ignore_index"]), dtype=np.float64))


def _nll_backward_shape(shapes, attrs, ctx):
    grad, logp, target, total_weight = shapes
    _check_nll_shapes(logp, target, "nll_loss_backward")
    expected = tuple(target) if _reduction(attrs, "nll_loss_backward") == "none" else ()
    if not same_shape(grad, expected):
        raise ShapeError(f"nll_loss_backward: grad {fmt(grad)} is not the loss's shape {fmt(expected)}")
    if not numel(total_weight) == 1:
        raise ShapeError(f"nll_loss_backward: total_weight {fmt(total_weight)} is not a scalar")
    return tuple(logp)


def _nll_backward(xs, attrs, ctx):
    grad, logp, target, total_weight = xs
    counts = (target != attrs["ignore_index"]).reshape(-1)
    reduction = _reduction(attrs, "nll_loss_backward")
    if reduction == "none":
        scale = grad.reshape(-1)
    else:
        per_target = grad / total_weight.reshape(()) if reduction == "mean" else grad
        scale = np.broadcast_to(per_target, counts.shape)
    out = np.zeros(logp.reshape(-1, logp.shape[-1]).shape, dtype=np.float64)
    rows = np.nonzero(counts)[0]
    out[rows, target.reshape(-1)[rows]] = -scale[rows]
    return out.reshape(logp.shape)


rule(Op.NLL_LOSS_BACKWARD, shape=_nll_backward_shape, dtype=_float, concrete=_nll_backward)
